"""A model folder's config files: ``model_index.json`` (the diffusers pipeline class and its
components, and the pipeline's own plain settings), ``generation_config.json`` (its sampling
defaults and the limits it was trained for) and ``diffserve_cache.json`` (its step-caching
calibration, written by ``diffserve calibrate-cache``). Read by the loader (which class to build), by the
pipeline adapters (settings such as Wan 2.2's ``boundary_ratio``, the defaults), by the CLI
before it starts replicas (a folder that cannot be served fails there, early) and before the
weights load (a size beyond the model's stated limits fails there). torch-free.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from diffserve.core.errors import InvalidRequestError, UnsupportedModelError
from diffserve.core.sampling_params import ModelSpec, SamplingParams

GENERATION_CONFIG = "generation_config.json"
#: The folder's step-caching calibration (``diffserve calibrate-cache``): ``{"teacache":
#: {"coefficients": [...], "cache_quality": {level: {"budget": b}}, "source": "..."},
#: "calibration": {what it was measured on}}``.
CACHE_CALIBRATION = "diffserve_cache.json"
#: Keys of ``generation_config.json``'s ``limits``: the largest values the model was trained for.
LIMIT_KEYS = ("max_height", "max_width", "max_num_frames")
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


def takes_a_prompt(model_dir: Path) -> bool | None:
    """Whether the folder's pipeline reads a prompt, from its ``model_index.json`` alone: False
    when it lists no tokenizer (an unconditional pipeline such as ``DDIMPipeline``), True when
    it does, None when the folder or its index cannot be read."""
    try:
        index = read_model_index(model_dir)
    except UnsupportedModelError:
        return None
    return any(name.startswith("tokenizer") and isinstance(entry, list) and entry and entry[0] is not None
               for name, entry in index.items())


def pipeline_config(model_dir: Path | None) -> dict[str, Any]:
    """The pipeline's own settings in ``model_index.json`` (plain values such as Wan 2.2's
    ``boundary_ratio``, SD's ``requires_safety_checker``, SDXL's
    ``force_zeros_for_empty_prompt``; components and ``_``-keys left out); {} without a folder."""
    if model_dir is None or not (Path(model_dir) / "model_index.json").is_file():
        return {}
    return {k: v for k, v in read_model_index(model_dir).items()
            if not k.startswith("_") and not isinstance(v, list)}


def _read_json_object(model_dir: Path | None, name: str) -> dict[str, Any]:
    """The folder's JSON file `name` as a dict ({} when absent or without a folder).

    Raises:
        UnsupportedModelError: the file exists but is not a JSON object.
    """
    if model_dir is None:
        return {}
    path = Path(model_dir) / name
    if not path.is_file():
        return {}
    try:
        content = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise UnsupportedModelError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(content, dict):
        raise UnsupportedModelError(f"{path} must hold a JSON object")
    return content


def read_generation_config(model_dir: Path | None) -> dict[str, Any]:
    """The folder's ``generation_config.json`` as a dict ({} when absent or without a folder).

    Raises:
        UnsupportedModelError: the file exists but is not a JSON object.
    """
    return _read_json_object(model_dir, GENERATION_CONFIG)


def read_cache_calibration(model_dir: Path | None) -> dict[str, Any]:
    """The folder's ``diffserve_cache.json`` as a dict ({} when absent or without a folder).

    Raises:
        UnsupportedModelError: the file exists but is not a JSON object whose ``teacache``
            (when present) is an object.
    """
    calibration = _read_json_object(model_dir, CACHE_CALIBRATION)
    if not isinstance(calibration.get("teacache", {}), dict):
        raise UnsupportedModelError(f"{Path(model_dir) / CACHE_CALIBRATION}: 'teacache' must be an object "
                                    "(diffserve calibrate-cache writes it)")
    return calibration


def stated_limits(model_dir: Path | None) -> dict[str, int]:
    """The limits a model states in ``generation_config.json`` (``"limits": {"max_height": 16,
    "max_width": 16, "max_num_frames": 9}``: pixels and frames it was trained for); {} when it
    states none.

    Raises:
        UnsupportedModelError: ``limits`` is not an object of `LIMIT_KEYS` with positive integers.
    """
    limits = read_generation_config(model_dir).get("limits", {})
    if not isinstance(limits, dict) or any(k not in LIMIT_KEYS or isinstance(v, bool) or not isinstance(v, int)
                                           or v < 1 for k, v in limits.items()):
        raise UnsupportedModelError(f"{Path(model_dir) / GENERATION_CONFIG}: 'limits' must map {', '.join(LIMIT_KEYS)} "
                                    f"to positive integers, got {limits!r}")
    return dict(limits)


def with_stated_limits(spec: ModelSpec, model_dir: Path | None) -> ModelSpec:
    """`spec` with its largest height, width and frame count narrowed to the model's
    `stated_limits` (each the smaller of the architecture's and the stated one), then its
    default size and frame count fitted within them (`fit_defaults`)."""
    limits = stated_limits(model_dir)
    narrowed = {}
    for key, value in limits.items():
        own = getattr(spec, key)
        narrowed[key] = value if own is None else min(own, value)
    return fit_defaults(dataclasses.replace(spec, **narrowed) if narrowed else spec)


def fit_defaults(spec: ModelSpec) -> ModelSpec:
    """`spec` with a default size / frame count the model accepts: a family default beyond
    ``max_height`` / ``max_width`` (e.g. Wan's 480x832 on a folder whose RoPE grid stops at
    512 pixels and that ships no ``generation_config.json``) is scaled down, keeping its aspect
    ratio, to multiples of ``resolution_factor`` (at least one); a ``default_num_frames`` beyond
    ``max_num_frames`` becomes the largest ``frame_factor * m + 1`` within it. Requests without
    a size and the compile warm-up (`diffserve.acceleration.accelerator`) then use a valid one.
    Defaults within the limits are kept as they are."""
    f = spec.resolution_factor
    height, width = spec.default_height, spec.default_width
    scale = min([1.0, *(limit / value for limit, value in ((spec.max_height, height), (spec.max_width, width))
                        if limit is not None and value)])
    changes = {}
    if scale < 1.0:
        changes["default_height"] = max(f, int(height * scale) // f * f)
        changes["default_width"] = max(f, int(width * scale) // f * f)
    frames, top = spec.default_num_frames, spec.max_num_frames
    if frames is not None and top is not None and frames > top:
        changes["default_num_frames"] = (top - 1) // spec.frame_factor * spec.frame_factor + 1
    return dataclasses.replace(spec, **changes) if changes else spec


def check_stated_limits(model_dir: Path | None, params: SamplingParams) -> None:
    """Check a request's explicit size and frame count against the model's `stated_limits`
    from its config files alone (before its weights load; the loaded model checks everything
    again, with the same limits).

    Raises:
        InvalidRequestError: naming ``height``, ``width`` or ``num_frames`` and the limit.
    """
    limits = stated_limits(model_dir)
    for field, key, unit in (("height", "max_height", "pixels"), ("width", "max_width", "pixels"),
                             ("num_frames", "max_num_frames", "frames")):
        value = getattr(params, field)
        if key in limits and isinstance(value, int) and value > limits[key]:
            raise InvalidRequestError(field, value, f"at most {limits[key]} {unit} for this model (the "
                                      f"{'size' if unit == 'pixels' else 'length'} it was trained for, "
                                      f"{GENERATION_CONFIG} limits)")
