"""Builders for tiny random-weight diffusers pipelines, made offline for the tests.

Each ``build_tiny_*(out, ...)`` makes a real diffusers pipeline of one family from small configs
(seeded random weights, real VAE down-sampling factors), ``save_pretrained``s it to ``out`` (a few
MB at most) and returns ``out``; reload it with the pipeline class's ``from_pretrained``. Nothing
is downloaded. One module per family; each module's docstring lists the diffusers ``__call__``
behaviour that matters for parity (defaults, timesteps, guidance, packing, decode).

| builder | pipeline class | module |
|---|---|---|
| :func:`build_tiny_sd3` | ``StableDiffusion3Pipeline`` | ``sd3`` |
| :func:`build_tiny_flux` (``variant="schnell"`` / ``"dev"``) | ``FluxPipeline`` | ``flux`` |
| :func:`build_tiny_flux_kontext` | ``FluxKontextPipeline`` | ``flux`` |
| :func:`build_tiny_sd15` (scheduler, ``prediction_type``) | ``StableDiffusionPipeline`` | ``stable_diffusion`` |
| :func:`build_tiny_sdxl` | ``StableDiffusionXLPipeline`` | ``sdxl`` |
| :func:`build_tiny_qwen_image` | ``QwenImagePipeline`` | ``qwen_image`` |
| :func:`build_tiny_qwen_image_edit` | ``QwenImageEditPipeline`` (+ ``load_qwen2vl_processor``) | ``qwen_image`` |
| :func:`build_tiny_wan` | ``WanPipeline`` (Wan 2.1 T2V) | ``wan`` |
| :func:`build_tiny_wan22` | ``WanPipeline`` (Wan 2.2, two experts) | ``wan`` |
| :func:`build_tiny_glm_image` | ``GlmImagePipeline`` (AR stage + DiT) | ``glm_image`` |
"""

from .components import t5_tokenizer
from .flux import build_tiny_flux, build_tiny_flux_kontext
from .glm_image import build_tiny_glm_image
from .qwen_image import (
    Qwen2VLImageOnlyProcessor,
    build_tiny_qwen_image,
    build_tiny_qwen_image_edit,
    load_qwen2vl_processor,
)
from .sd3 import build_tiny_sd3
from .sdxl import build_tiny_sdxl
from .stable_diffusion import build_tiny_sd15
from .wan import build_tiny_wan, build_tiny_wan22

__all__ = [
    "Qwen2VLImageOnlyProcessor",
    "build_tiny_flux",
    "build_tiny_flux_kontext",
    "build_tiny_glm_image",
    "build_tiny_qwen_image",
    "build_tiny_qwen_image_edit",
    "build_tiny_sd15",
    "build_tiny_sd3",
    "build_tiny_sdxl",
    "build_tiny_wan",
    "build_tiny_wan22",
    "load_qwen2vl_processor",
    "t5_tokenizer",
]
