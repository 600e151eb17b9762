"""Registry of pipeline adapters keyed by the diffusers pipeline ``_class_name``."""

from __future__ import annotations

from diffserve.errors import UnsupportedModelError
from diffserve.pipelines.base import PipelineAdapter
from diffserve.pipelines.sd3 import StableDiffusion3Adapter

_ADAPTERS: dict[str, type[PipelineAdapter]] = {
    cls.pipeline_class_name: cls for cls in (StableDiffusion3Adapter,)
}


def supported_pipelines() -> list[str]:
    """Names of the diffusers pipeline classes diffserve can serve."""
    return sorted(_ADAPTERS)


def adapter_class(pipeline_class_name: str) -> type[PipelineAdapter]:
    """Adapter for a pipeline class name.

    Raises:
        UnsupportedModelError: no adapter for that class (the message lists supported ones).
    """
    try:
        return _ADAPTERS[pipeline_class_name]
    except KeyError:
        raise UnsupportedModelError(
            f"unsupported pipeline class {pipeline_class_name!r}; supported: "
            + ", ".join(supported_pipelines())
        ) from None
