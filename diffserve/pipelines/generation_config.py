"""Per-model sampling defaults shipped in ``<model>/generation_config.json``.

A model folder may carry the defaults its authors recommend (keys: ``num_inference_steps``,
``guidance_scale``, ``true_cfg_scale``, ``height``, ``width``, ``num_frames``, ``fps``,
``max_sequence_length``) and acceleration presets (``teacache``: ``coefficients``,
``rel_l1_thresh``, ``source``). They override the family's diffusers ``__call__`` defaults.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from diffserve.core.errors import UnsupportedModelError

GENERATION_CONFIG = "generation_config.json"


def read_generation_config(model_dir: Path | None) -> dict[str, Any]:
    """The folder's ``generation_config.json`` as a dict ({} when absent).

    Raises:
        UnsupportedModelError: the file exists but is not a JSON object.
    """
    if model_dir is None:
        return {}
    path = Path(model_dir) / GENERATION_CONFIG
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise UnsupportedModelError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise UnsupportedModelError(f"{path} must hold a JSON object")
    return config
