"""The package layout's rules (docs/ARCHITECTURE.md), counting every import: module level, inside
functions and under ``TYPE_CHECKING`` (grimp's default, which the import-linter contracts in
pyproject.toml keep).

- no package-level import cycle anywhere in ``diffserve/`` (between the top-level layers, and
  between the sub-packages inside any package);
- the shared types (``diffserve.core``) import nothing else of diffserve;
- ``lint-imports`` keeps every contract of pyproject.toml, and breaks one when a forbidden import
  is added (checked on a copy of the package with a deliberate violation);
- the entrypoints reach the engine only through its client: no import of another engine module
  (the contract), and no attribute reach-in past the client (``.executor``, ``.scheduler``,
  ``.runner``, the engine behind the async engine, an engine's private attributes), which
  import-linter cannot see (an AST check).
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import grimp
import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph("diffserve", exclude_type_checking_imports=False, cache_dir=None)


def _children_graph(graph: grimp.ImportGraph, package: str) -> dict[str, set[str]]:
    """Imports between the direct children of `package`, each child sub-package collapsed to one
    node (with every module below it)."""
    depth = package.count(".") + 2
    edges: dict[str, set[str]] = defaultdict(set)
    for module in graph.modules:
        if not module.startswith(package + "."):
            continue
        source = ".".join(module.split(".")[:depth])
        for imported in graph.find_modules_directly_imported_by(module):
            if imported.startswith(package + "."):
                target = ".".join(imported.split(".")[:depth])
                if target != source:
                    edges[source].add(target)
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(edges.get(node, ())):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                other = stack.pop()
                on_stack.discard(other)
                component.append(other)
                if other == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(set(edges) | {t for targets in edges.values() for t in targets}):
        if node not in index:
            visit(node)
    return found


def test_no_package_cycles(graph):
    """No cycle that runs through a sub-package, at any level of diffserve (cycles between plain
    modules of one package, e.g. the step contract and its batch type, are not package cycles)."""
    packages = sorted(m for m in graph.modules if graph.find_children(m))
    problems = []
    for package in packages:
        for cycle in _cycles(_children_graph(graph, package)):
            if any(graph.find_children(node) for node in cycle):
                problems.append(f"{package}: {' <-> '.join(cycle)}")
    assert packages and "diffserve.core" in packages
    assert not problems, "package cycles:\n" + "\n".join(problems)


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": {"c"}}) == []


def test_core_imports_nothing_else_of_diffserve(graph):
    outside = sorted(
        f"{module} -> {imported}"
        for module in graph.modules if module == "diffserve.core" or module.startswith("diffserve.core.")
        for imported in graph.find_modules_directly_imported_by(module)
        if imported.split(".")[0] == "diffserve" and not (imported == "diffserve.core"
                                                           or imported.startswith("diffserve.core."))
    )
    assert not outside, outside


def test_every_layer_is_in_the_layers_contract(graph):
    """A new top-level package (or module) of diffserve must take its place in the layers."""
    import tomllib

    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    layers = next(c for c in config["contracts"] if c["type"] == "layers")
    named = {name.strip() for row in layers["layers"] for name in row.replace(":", "|").split("|")}
    top = {m.split(".")[1] for m in graph.modules if m.count(".") == 1} - {"__main__"}
    assert top - named == set(), f"not in the layers contract: {sorted(top - named)}"


def _lint_imports(cwd: Path, pythonpath: Path) -> subprocess.CompletedProcess:
    code = "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(no_cache=True))"
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(pythonpath), "PATH": "/usr/bin:/bin", "NO_COLOR": "1"})


def test_import_linter_contracts_are_kept():
    result = _lint_imports(REPO, REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_import_linter_breaks_on_a_forbidden_import(tmp_path):
    """The same contracts on a copy of the package where the request scheduler imports the
    runner: lint-imports exits non-zero and names the import."""
    copy = tmp_path / "diffserve"
    shutil.copytree(REPO / "diffserve", copy, ignore=shutil.ignore_patterns("__pycache__", "weights", "static"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    scheduler = copy / "engine" / "scheduler.py"
    text = scheduler.read_text()
    anchor = "from diffserve.core.errors import InteractionRefusedError, InvalidRequestError\n"
    assert anchor in text
    scheduler.write_text(text.replace(anchor, anchor + "from diffserve.runner.loader import load_adapter\n"))
    result = _lint_imports(tmp_path, tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "diffserve.engine.scheduler -> diffserve.runner.loader" in result.stdout
    assert "1 broken" in result.stdout


def test_an_entrypoint_importing_an_engine_internal_breaks_the_contract(tmp_path):
    """The engine client is the entrypoints' one door into the engine: importing the request
    scheduler from the CLI breaks ``entrypoints-via-engine-client``."""
    copy = tmp_path / "diffserve"
    shutil.copytree(REPO / "diffserve", copy, ignore=shutil.ignore_patterns("__pycache__", "weights", "static"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    cli = copy / "entrypoints" / "cli.py"
    anchor = "from diffserve.models import builtin_name\n"
    text = cli.read_text()
    assert anchor in text
    cli.write_text(text.replace(anchor, anchor + "from diffserve.engine.scheduler import RequestScheduler\n"))
    result = _lint_imports(tmp_path, tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "diffserve.entrypoints.cli -> diffserve.engine.scheduler" in result.stdout


#: Attributes of an engine that are no entrypoint's business (the engine client has them all).
ENGINE_INTERNALS = {"executor", "scheduler", "runner", "queues", "sleep_mode", "memory_budget"}


def _engine_reach_ins(source: str) -> list[str]:
    """Attribute reach-ins past the engine client in `source`, on anything called engine: an
    engine internal by name, the synchronous engine behind the async one (``x.engine.engine``),
    or a private attribute."""

    def mentions_engine(node: ast.expr) -> bool:
        if isinstance(node, ast.Name):
            return "engine" in node.id
        return isinstance(node, ast.Attribute) and "engine" in node.attr

    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute):
            continue
        private = node.attr.startswith("_") and not node.attr.startswith("__")
        if mentions_engine(node.value) and (node.attr in ENGINE_INTERNALS or node.attr == "engine" or private):
            found.append((node.lineno, f"line {node.lineno}: .{node.attr}"))
    return [hit for _, hit in sorted(found)]


def test_entrypoints_reach_the_engine_only_through_its_client():
    problems = [f"{path.relative_to(REPO)} {hit}" for path in sorted((REPO / "diffserve" / "entrypoints").rglob("*.py"))
                for hit in _engine_reach_ins(path.read_text())]
    assert not problems, "reach-ins past the engine client:\n" + "\n".join(problems)


def test_the_reach_in_check_finds_reach_ins():
    assert _engine_reach_ins("engine.executor.plan(p)\nx = state.engine.engine.spec\nself.engine._wake.set()") == [
        "line 1: .executor", "line 2: .engine", "line 3: ._wake"]
    assert _engine_reach_ins("engine.input_processor.process(p)\nself._engine.abort(i)\nparser._actions\n"
                             "args.executor") == []
