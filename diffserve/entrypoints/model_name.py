"""The name a served or generated-with model goes by (``/v1/models``, PNG metadata)."""

from __future__ import annotations

import os
from pathlib import Path

#: Name of the built-in default model (`diffserve.models.digits`).
DEFAULT_MODEL_NAME = "diffserve-digits"


def model_name(model: str | os.PathLike | None) -> str:
    """``diffserve-digits`` for the built-in model (None), else the model folder's name."""
    if model is None:
        return DEFAULT_MODEL_NAME
    return Path(model).expanduser().resolve().name or str(model)
