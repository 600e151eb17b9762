"""GGUF single-file transformers, loaded through diffusers' GGUF support.

A GGUF file (llama.cpp's format; for diffusion models e.g. city96's FLUX.1 / SD3.5 files) holds
a denoiser's weights in ggml's block-quantized types (Q8_0, Q4_K, ...). diffusers'
``from_single_file(path, config=..., quantization_config=GGUFQuantizationConfig(compute_dtype))``
converts the original checkpoint layout to its own names, keeps the packed blocks as
``GGUFParameter`` s (uint8) and replaces each linear layer by a ``GGUFLinear`` that dequantizes
its weight on the fly at every forward (in the model dtype; on CUDA with the optional
``kernels`` package a fused kernel). The rest of the folder (text encoders, VAE, scheduler)
comes from the folder as usual; the denoiser's config comes from the folder's own subfolder, so
the file must hold that architecture at that size.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from diffserve.core.errors import InvalidRequestError, UnsupportedModelError

logger = logging.getLogger(__name__)


def gguf_metadata(path: Path) -> tuple[str | None, dict[str, tuple[int, ...]]]:
    """The file's ``general.architecture`` (None if absent) and its tensors' names and shapes
    (in torch order), read from the header only.

    Raises:
        UnsupportedModelError: not a readable GGUF file.
    """
    try:
        from gguf import GGUFReader
    except ImportError as exc:
        raise InvalidRequestError("transformer_file", str(path), "unset, or install gguf: pip install 'diffserve[quantization]'",
                                  str(exc)) from exc
    try:
        reader = GGUFReader(str(path))
    except Exception as exc:  # noqa: BLE001 - any parse failure means "not a GGUF file"
        raise UnsupportedModelError(f"transformer file {path} is not a readable GGUF file: {exc}") from exc
    arch = None
    field = reader.fields.get("general.architecture")
    if field is not None:
        try:
            arch = bytes(field.parts[field.data[0]]).decode()
        except (IndexError, UnicodeDecodeError):
            arch = None
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape.tolist())) for t in reader.tensors}
    return arch, shapes


def load_gguf_transformer(path: str | Path, cls: type, config_folder: Path, dtype: torch.dtype,
                          device: torch.device | str = "cpu") -> Any:
    """Load a denoiser of class `cls` from a GGUF file, with the config of `config_folder`.

    Args:
        cls: the folder's denoiser class (e.g. ``SD3Transformer2DModel``); it must be one
            diffusers can load from a single file.
        dtype: the compute dtype (weights are dequantized to it at every forward).

    Returns:
        The model, its linear weights as ``GGUFParameter`` s.

    Raises:
        UnsupportedModelError: the file is missing or not GGUF; diffusers cannot load `cls` from
            a single file; or the file holds another architecture or another size than the
            folder's denoiser (the message names the class, the file's architecture and
            tensors that are missing or differ).
    """
    path = Path(path)
    if not path.is_file():
        raise UnsupportedModelError(f"transformer file {path} does not exist")
    arch, shapes = gguf_metadata(path)
    from diffusers import GGUFQuantizationConfig

    if not hasattr(cls, "from_single_file"):
        raise UnsupportedModelError(f"diffusers cannot load {cls.__name__} from a single file (GGUF); "
                                    "serve this model from its folder")
    described = f"{path.name} ({len(shapes)} tensors" + (f", architecture {arch!r})" if arch else ")")
    mismatch = (f"transformer file {described} does not hold this folder's {cls.__name__} "
                f"({config_folder}/config.json)")
    check_layout(shapes, cls, config_folder, mismatch)
    try:
        model = cls.from_single_file(str(path), config=str(config_folder.parent), subfolder=config_folder.name,
                                     quantization_config=GGUFQuantizationConfig(compute_dtype=dtype),
                                     torch_dtype=dtype, local_files_only=True)
    except (KeyError, ValueError, RuntimeError, IndexError, AttributeError, TypeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UnsupportedModelError(f"{mismatch}: its tensors (e.g. {', '.join(list(shapes)[:3])}) do not convert "
                                    f"to {cls.__name__} ({first[:200]})") from exc
    missing = [n for n, p in [*model.named_parameters(), *model.named_buffers()] if p.device.type == "meta"]
    if missing:
        raise UnsupportedModelError(f"{mismatch}: {len(missing)} of its weights are not in the file (e.g. "
                                    f"{', '.join(missing[:3])})")
    model = model.to(device).eval().requires_grad_(False)
    logger.info("loaded %s from %s", cls.__name__, described)
    return model


def check_layout(shapes: dict[str, tuple[int, ...]], cls: type, config_folder: Path, mismatch: str) -> None:
    """When a file's tensors are mostly named as the folder's diffusers model (diffusers'
    own layout rather than the original checkpoint's, which diffusers converts), check that
    the names and shapes are exactly the model's.

    Raises:
        UnsupportedModelError: ``mismatch`` followed by the missing, unexpected or
            differently-shaped tensors.
    """
    from accelerate import init_empty_weights

    with init_empty_weights():
        model = cls.from_config(cls.load_config(config_folder))
    expected = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    if len(shapes.keys() & expected.keys()) < len(shapes) / 2:
        return  # the original layout: diffusers converts it (and says when it cannot)
    missing = [n for n in expected if n not in shapes]
    unexpected = [n for n in shapes if n not in expected]
    wrong = [f"{n} {shapes[n]} (expected {expected[n]})" for n in shapes.keys() & expected.keys()
             if shapes[n] != expected[n]]
    problems = [f"{len(items)} {what} (e.g. {', '.join(sorted(items)[:2])})"
                for what, items in (("missing", missing), ("unexpected", unexpected), ("of another shape", wrong))
                if items]
    if problems:
        raise UnsupportedModelError(f"{mismatch}: tensors " + "; ".join(problems))
