"""A model folder's ``model_index.json``: the diffusers pipeline class and its components, and
the pipeline's own plain settings. Read by the loader (which class to build), by the pipeline
adapters (settings such as Wan 2.2's ``boundary_ratio``) and by the CLI before it starts
replicas (a folder that cannot be served fails there, early). torch-free.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from diffserve.core.errors import UnsupportedModelError
from diffserve.models import BUILTIN_MODELS, builtin_name


def read_model_index(model_dir: Path) -> dict[str, Any]:
    """Parse ``model_dir/model_index.json``.

    Raises:
        UnsupportedModelError: the folder does not exist (the message lists the built-in model
            names; a missing built-in folder gets its own message), or its model_index.json is
            missing or unreadable. (Hub ids are fetched before: `diffserve.models.resolve_model`.)
    """
    model_dir = Path(model_dir)
    index_path = model_dir / "model_index.json"
    if not model_dir.exists():
        builtin = builtin_name(model_dir)
        if builtin is not None:
            raise UnsupportedModelError(f"the built-in model {builtin!r} is not part of this installation (its "
                                        f"folder {model_dir} does not exist)")
        raise UnsupportedModelError(f"model folder {model_dir} does not exist, and {str(model_dir)!r} is not a "
                                    f"built-in model name ({', '.join(BUILTIN_MODELS)}), nor a Hugging Face Hub id (ORG/NAME)")
    if not index_path.is_file():
        raise UnsupportedModelError(
            f"{model_dir} is not a diffusers model folder (no model_index.json); pass a local "
            "folder saved with save_pretrained"
        )
    try:
        return json.loads(index_path.read_text())
    except json.JSONDecodeError as exc:
        raise UnsupportedModelError(f"{index_path} is not valid JSON: {exc}") from exc


def pipeline_config(model_dir: Path | None) -> dict[str, Any]:
    """The pipeline's own settings in ``model_index.json`` (plain values such as Wan 2.2's
    ``boundary_ratio``, SD's ``requires_safety_checker``, SDXL's
    ``force_zeros_for_empty_prompt``; components and ``_``-keys left out); {} without a folder."""
    if model_dir is None or not (Path(model_dir) / "model_index.json").is_file():
        return {}
    return {k: v for k, v in read_model_index(model_dir).items()
            if not k.startswith("_") and not isinstance(v, list)}
