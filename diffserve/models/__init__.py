"""Models that ship with diffserve, addressed by name (no download).

==================  =================================  ===========================================
name                folder (in this package)           what
==================  =================================  ===========================================
``digits``          ``digits/weights``                 text-to-image (and image-to-image) of 8x8
                                                       handwritten digits; the default model
``digits-video``    ``digits_video/weights``           text-to-video (Wan 2.1 layout) of moving
                                                       digits
``digits-reasoning`` ``digits_reasoning/weights``      two stages: a causal LM answers an
                                                       arithmetic prompt, a DiT reading its K/V
                                                       draws the answer
==================  =================================  ===========================================

A model argument (``EngineConfig.model``, ``--model``) is resolved by `resolve_model`: None is
the default (``digits``); an existing folder is used as given (so a local folder that happens
to be called ``digits`` wins); otherwise a built-in name maps to its folder; a Hugging Face Hub
id ``ORG/NAME[@REVISION]`` is fetched into the Hub cache (`diffserve.models.hub`); anything
else is returned as a path for the loader to report (``model folder ... does not exist``,
listing the built-in names). Served under ``diffserve-<name>`` (a built-in model), ``ORG/NAME``
(a Hub id) or the folder's name (`served_name`).

This module imports nothing heavy (no torch): the CLI resolves names before loading anything.
"""

from __future__ import annotations

import os
from pathlib import Path

_HERE = Path(__file__).resolve().parent

#: Built-in model name -> its diffusers folder.
BUILTIN_MODELS: dict[str, Path] = {
    "digits": _HERE / "digits" / "weights",
    "digits-video": _HERE / "digits_video" / "weights",
    "digits-reasoning": _HERE / "digits_reasoning" / "weights",
}
#: Built-in model name -> its own LoRA adapters (name -> folder), usable by name with no
#: ``--lora`` (``diffserve generate "a handwritten digit 3" --lora mirror``); each folder has a
#: ``LORA_CARD.md``.
BUILTIN_LORAS: dict[str, dict[str, Path]] = {
    "digits": {"mirror": _HERE / "digits" / "loras" / "mirror"},
}
#: Built-in model name -> typical prompts in its vocabulary (one per digit, several of its
#: training templates; MODEL_CARD.md), for tools that run the model on its own kind of requests
#: (``diffserve calibrate-cache``).
BUILTIN_PROMPTS: dict[str, tuple[str, ...]] = {
    "digits": ("a handwritten digit 0", "digit 1", "the number two", "a picture of the number 3",
               "handwritten four", "a photo of the numeral 5", "show me a six", "a single hand written digit 7",
               "a sketch of number 8", "white nine on black"),
    "digits-video": ("a handwritten digit 0 moving left", "digit 1 moving right", "the number two going up",
                     "a picture of the number 3 sliding down", "handwritten four moves left",
                     "a photo of the numeral 5 that moves right", "show me a six moving to the left",
                     "a single hand written digit 7 going down", "a sketch of number 8 sliding up",
                     "white nine on black moving right"),
}
#: The model used when none is given.
DEFAULT_MODEL = "digits"
#: Prefix of the served names of built-in models (``diffserve-digits``).
SERVED_NAME_PREFIX = "diffserve-"


def resolve_model(model: str | os.PathLike | None, download_dir: str | os.PathLike | None = None,
                  variant: str | None = None) -> Path:
    """The folder `model` refers to.

    Args:
        model: None (the default model), a path, a built-in name (`BUILTIN_MODELS`) or a Hub id
            ``ORG/NAME[@REVISION]``.
        download_dir / variant: where a Hub id's files go (None = the Hub cache) and which
            weights variant they are (see `diffserve.models.hub.download_model`).

    Returns:
        An existing folder given as a path as is (``~`` expanded); else the built-in folder of
        that name; else a Hub id's snapshot folder (fetched when needed); else the path as given
        (it does not exist: the loader says so).

    Raises:
        UnsupportedModelError: a Hub id that cannot be fetched (see `download_model`).
    """
    if model is None:
        return BUILTIN_MODELS[DEFAULT_MODEL]
    path = Path(model).expanduser()
    if path.exists():
        return path
    if str(model) in BUILTIN_MODELS:
        return BUILTIN_MODELS[str(model)]
    from diffserve.models.hub import download_model, parse_hub_id

    hub_id = parse_hub_id(model)
    if hub_id is not None:
        return download_model(hub_id, download_dir, variant)
    return path


def builtin_name(model: str | os.PathLike | None) -> str | None:
    """The built-in model `model` refers to (None, a built-in name, or the path of a built-in
    folder), else None."""
    from diffserve.models.hub import parse_hub_id

    if parse_hub_id(model) is not None:
        return None
    folder = resolve_model(model).resolve()
    return next((name for name, path in BUILTIN_MODELS.items() if path == folder), None)


def builtin_loras(model: str | os.PathLike | None) -> dict[str, Path]:
    """The LoRA adapters shipped with the model `model` refers to (name -> folder); empty for a
    model that is not built in."""
    name = builtin_name(model)
    return dict(BUILTIN_LORAS.get(name, {})) if name is not None else {}


def served_name(model: str | os.PathLike | None) -> str:
    """The name a model goes by in ``/v1/models`` and in file metadata: ``diffserve-<name>``
    for a built-in model, ``ORG/NAME`` for a Hub id (as vLLM names it), else the model folder's
    name. Fetches nothing."""
    from diffserve.models.hub import parse_hub_id

    hub_id = parse_hub_id(model)
    if hub_id is not None and str(model) not in BUILTIN_MODELS:
        return hub_id.repo_id
    name = builtin_name(model)
    if name is not None:
        return SERVED_NAME_PREFIX + name
    return resolve_model(model).resolve().name or str(model)
