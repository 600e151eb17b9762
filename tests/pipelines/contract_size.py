"""How big each family's step adapter is: lines of code (no blank, comment or docstring lines) per
file of its folder, and which of the contract's methods (`PipelineAdapter`'s public ones) its
adapter class overrides. Pure `ast` / `tokenize`, nothing imported.

Run from the repository root: ``python tests/pipelines/contract_size.py [ROOT]`` (ROOT: another
checkout to compare). `tests/pipelines/test_contract.py` holds the targets of issue 23: a plain
DiT family's adapter <= 100 lines of code, Wan <= 6 overridden hooks.
"""

from __future__ import annotations

import ast
import io
import sys
import tokenize
from pathlib import Path

#: family folder -> its adapter class
FAMILIES = {"sd3": "StableDiffusion3Adapter", "flux": "FluxAdapter", "flux_kontext": "FluxKontextAdapter",
            "qwen_image": "QwenImageAdapter", "qwen_image_edit": "QwenImageEditAdapter",
            "stable_diffusion": "StableDiffusionAdapter", "stable_diffusion_xl": "StableDiffusionXLAdapter",
            "wan": "WanAdapter", "glm_image": "GlmImageAdapter", "digits_reasoning": "DigitsReasoningAdapter"}


def code_lines(path: Path) -> int:
    """Lines of `path` holding code: not blank, not only a comment, not part of a docstring."""
    source = path.read_text()
    docstrings: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                docstrings.update(range(first.lineno, first.end_lineno + 1))
    lines: set[int] = set()
    skip = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER)
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in skip:
            lines.update(n for n in range(token.start[0], token.end[0] + 1) if n not in docstrings)
    return len(lines)


def _class(path: Path, name: str) -> ast.ClassDef:
    return next(n for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef) and n.name == name)


def contract_methods(root: Path) -> list[str]:
    """`PipelineAdapter`'s public methods and properties."""
    base = _class(root / "diffserve/pipelines/base.py", "PipelineAdapter")
    return sorted(n.name for n in base.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_"))


def family_sizes(root: Path) -> dict[str, dict]:
    """Per family: ``adapter`` (its adapter.py's lines of code), ``files`` (lines per file of its
    folder, ``__init__.py`` left out) and ``hooks`` (the contract methods its class overrides)."""
    methods = set(contract_methods(root))
    sizes = {}
    for family, cls in FAMILIES.items():
        folder = root / "diffserve/pipelines" / family
        adapter = folder / "adapter.py"
        if not adapter.exists():  # an older checkout without this family
            continue
        body = _class(adapter, cls).body
        sizes[family] = {
            "adapter": code_lines(adapter),
            "files": {p.name: code_lines(p) for p in sorted(folder.glob("*.py")) if p.name != "__init__.py"},
            "hooks": sorted(n.name for n in body if isinstance(n, ast.FunctionDef) and n.name in methods),
        }
    return sizes


def main() -> None:
    """Print the table for the checkout at argv[1] (default: this one)."""
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[2]
    print(f"{len(contract_methods(root))} public methods in PipelineAdapter")
    print(f"{'family':20s} {'adapter.py':>10s} {'folder':>7s}  overridden hooks")
    for family, size in family_sizes(root).items():
        print(f"{family:20s} {size['adapter']:10d} {sum(size['files'].values()):7d}  {len(size['hooks'])}: "
              f"{', '.join(size['hooks'])}")


if __name__ == "__main__":
    main()
