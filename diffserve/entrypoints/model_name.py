"""The name a served or generated-with model goes by (``/v1/models``, file metadata)."""

from __future__ import annotations

import os

from diffserve.models import SERVED_NAME_PREFIX, DEFAULT_MODEL, served_name

#: Name of the built-in default model (`diffserve.models.digits`).
DEFAULT_MODEL_NAME = SERVED_NAME_PREFIX + DEFAULT_MODEL


def model_name(model: str | os.PathLike | None) -> str:
    """``diffserve-<name>`` for a built-in model (None is ``digits``), else the model folder's
    name (see `diffserve.models.served_name`)."""
    return served_name(model)
