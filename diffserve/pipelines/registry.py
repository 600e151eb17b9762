"""Registry of pipeline adapters keyed by the diffusers pipeline ``_class_name``.

Adapters are imported on first use, so loading one family never imports the others (each
pulls its diffusers pipeline module and text-encoder classes).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from diffserve.core.errors import UnsupportedModelError

if TYPE_CHECKING:
    from diffserve.pipelines.base import PipelineAdapter

#: pipeline class name -> "module:AdapterClass"
_ADAPTERS: dict[str, str] = {
    "StableDiffusion3Pipeline": "diffserve.pipelines.sd3.adapter:StableDiffusion3Adapter",
    "FluxPipeline": "diffserve.pipelines.flux.adapter:FluxAdapter",
    "FluxKontextPipeline": "diffserve.pipelines.flux_kontext.adapter:FluxKontextAdapter",
    "QwenImagePipeline": "diffserve.pipelines.qwen_image.adapter:QwenImageAdapter",
    "QwenImageEditPipeline": "diffserve.pipelines.qwen_image_edit.adapter:QwenImageEditAdapter",
    "WanPipeline": "diffserve.pipelines.wan.adapter:WanAdapter",
    "StableDiffusionPipeline": "diffserve.pipelines.stable_diffusion.adapter:StableDiffusionAdapter",
    "StableDiffusionXLPipeline": "diffserve.pipelines.stable_diffusion_xl.adapter:StableDiffusionXLAdapter",
    "GlmImagePipeline": "diffserve.pipelines.glm_image.adapter:GlmImageAdapter",
    "DigitsReasoningPipeline": "diffserve.pipelines.digits_reasoning.adapter:DigitsReasoningAdapter",
}


def supported_pipelines() -> list[str]:
    """Names of the diffusers pipeline classes diffserve serves with step batching."""
    return sorted(_ADAPTERS)


def has_adapter(pipeline_class_name: str) -> bool:
    """Whether a step adapter exists for the pipeline class."""
    return pipeline_class_name in _ADAPTERS


def adapter_class(pipeline_class_name: str) -> type["PipelineAdapter"]:
    """Adapter for a pipeline class name.

    Raises:
        UnsupportedModelError: no adapter for that class (the message lists supported ones).
    """
    target = _ADAPTERS.get(pipeline_class_name)
    if target is None:
        raise UnsupportedModelError(
            f"unsupported pipeline class {pipeline_class_name!r}; supported: "
            + ", ".join(supported_pipelines())
        )
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)
