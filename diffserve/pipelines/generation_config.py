"""Per-model sampling defaults shipped in ``<model>/generation_config.json``.

A model folder may carry the defaults its authors recommend (keys: ``num_inference_steps``,
``guidance_scale``, ``true_cfg_scale``, ``height``, ``width``, ``num_frames``, ``fps``,
``max_sequence_length``), acceleration presets (``teacache``: ``coefficients``,
``rel_l1_thresh``, ``source``) and the limits it was trained for (``limits``: ``max_height``,
``max_width``, ``max_num_frames``; see `diffserve.models.model_index.stated_limits`). The
defaults override the family's diffusers ``__call__`` defaults; the limits narrow what the
architecture allows. The file is read by `diffserve.models.model_index.read_generation_config`
(torch-free, so the CLI checks the limits before the weights load).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from diffserve.core.sampling_params import ModelSpec
from diffserve.models.model_index import GENERATION_CONFIG, read_generation_config, with_stated_limits

__all__ = ["GENERATION_CONFIG", "SPEC_DEFAULTS", "model_spec", "read_generation_config", "with_stated_limits"]


#: Sampling field -> (its `ModelSpec` default field, type).
SPEC_DEFAULTS: dict[str, tuple[str, type]] = {
    "height": ("default_height", int),
    "width": ("default_width", int),
    "num_inference_steps": ("default_num_inference_steps", int),
    "guidance_scale": ("default_guidance_scale", float),
    "true_cfg_scale": ("default_true_cfg_scale", float),
    "guidance_scale_2": ("default_guidance_scale_2", float),
    "max_sequence_length": ("default_max_sequence_length", int),
    "num_frames": ("default_num_frames", int),
    "fps": ("default_fps", int),
    "strength": ("default_strength", float),
}


def model_spec(pipeline: str, defaults: Mapping[str, Any], config: Mapping[str, Any],
               limits: Mapping[str, Any]) -> ModelSpec:
    """A model's `ModelSpec`: each sampling default of `defaults` (by sampling field, e.g.
    ``num_inference_steps``; the family's diffusers ``__call__`` defaults) replaced by the
    folder's `config` (``generation_config.json``) where it sets the field, plus the `limits`
    the components fix (`ModelSpec` fields: ``resolution_factor``, ``max_height``, ...). A
    sampling field absent from `defaults` is not used by the model (its default is None, so a
    request setting it is refused by name); ``guidance_scale`` defaults to None when absent.

    Raises:
        KeyError: a key of `defaults` is not a sampling field of `SPEC_DEFAULTS`.
    """
    fields: dict[str, Any] = {"default_guidance_scale": None}
    for name, value in defaults.items():
        spec_field, cast = SPEC_DEFAULTS[name]
        value = config.get(name, value)
        fields[spec_field] = None if value is None else cast(value)
    return ModelSpec(pipeline=pipeline, **fields, **limits)
