"""The registry of test models: every step-batched family's tiny folder (or built-in model), its
test sizes and steps, what it supports, and how diffusers' own pipeline is called on it.

One entry (`TestModel`) per folder the tests serve; ``tests/conformance/`` runs the same checks
over every entry (parametrized by `TestModel.id`: the pipeline class name, plus a variant where a
class has several folders), and ``tests/conftest.py``'s folder fixtures build through
`TestModel.folder`, so every folder is built once per session whichever test asks first.

What an entry declares is what the suite holds the family to: a field listed in `fields` must be
accepted, every other optional field refused by name; a backend listed in `backends` as True
must run (and equal the uncached engine at threshold 0), False must be refused by name. Adding a
family = one entry here (and its builder in this package); the conformance suite then covers it.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .flux import build_tiny_flux, build_tiny_flux_kontext
from .qwen_image import build_tiny_qwen_image, build_tiny_qwen_image_edit
from .sd3 import build_tiny_sd3
from .sdxl import build_tiny_sdxl
from .stable_diffusion import build_tiny_sd15
from .wan import build_tiny_wan, build_tiny_wan22

#: Optional request fields a family either uses or refuses by name (besides the fields every
#: family takes: prompt, negative_prompt, size, steps, seed, images per prompt, output type).
#: ``image``: input images; ``mask``: an inpainting mask (no family takes one yet).
OPTIONAL_FIELDS = ("guidance_scale", "true_cfg_scale", "guidance_scale_2", "max_sequence_length", "num_frames",
                   "fps", "strength", "num_chunks", "image", "mask")
#: Cache backends every family either runs or refuses by name (``compile`` has its focused
#: tests: a cold compile takes 10-45 s on CPU).
CACHE_BACKENDS = ("teacache", "cache_dit")


@dataclass(frozen=True)
class TestModel:
    """One test folder of a step-batched family.

    Attributes:
        id: test id: the pipeline class name, with ``-variant`` where a class has several folders.
        pipeline: ``_class_name`` of the folder's ``model_index.json``.
        build: ``build(out) -> out`` writes the tiny folder (None for a built-in model).
        builtin: built-in model name (``EngineConfig.model``) instead of a built folder.
        request: fields every request of the tests sets (size, steps, a short text budget), as
            `SamplingParams` keyword arguments.
        fields: the optional fields the family uses (`OPTIONAL_FIELDS`), each with a valid value
            other than its default (``image``: "optional" for image-to-image, "required" for edits).
        guided / unguided: fields turning guidance on (with a negative prompt where the family
            needs one) and off; `variations` vary it per request for the batching checks.
        backends: cache backend -> True (runs) / False (refused by name).
        video: outputs are videos (uint8 frames).
        channels: output channels (the built-in digits model is grayscale).
        reference: the diffusers pipeline class parity compares with; `reference_load` gives its
            ``from_pretrained`` keyword arguments for a folder, `reference_call` extra ``__call__``
            arguments for resolved params.
        img2img_reference: the diffusers class for image-to-image requests (``image`` "optional").
        parity_atol: largest |engine - diffusers| pixel difference allowed (pixels in [0, 1]);
            at most one uint8 level, tighter where measured so (the value's comment gives the
            measured one); video frames are uint8, one level by nature.
        forwards: denoiser forwards per request for N steps (PNDM runs N + 1).
        one_step: whether a 1-step request runs (Qwen-Image's ``shift_terminal`` schedules refuse it).
        cuts_text: whether prompts beyond the text encoders' budget are cut (Qwen-Image-Edit keeps
            the whole text, as diffusers' edit pipeline does).
        patch: a context manager every test of the family runs in (e.g. a smaller input area).
        input_size: (width, height) of the input images the tests send.
        samplers: the per-request ``scheduler`` names the family offers
            (`diffserve.pipelines.samplers`: all of them for noise-prediction models, those with a
            flow-matching mapping for flow models, fewer where the family's schedule arguments
            exclude one).
        mixed_sizes: (height, width) sizes, (height, width, num_frames) for video, whose
            requests share one forward (the family's `PipelineAdapter.mixed_sizes`; the first
            is `request`'s); empty: the family batches by size.
        mixed_inputs: (width, height) of each `mixed_sizes` request's input image (edits whose
            references of different sizes share the forward too); empty: `input_size`.
        mixed_atol: largest |mixed - alone| pixel difference of the `mixed_sizes` check; None:
            the harness's ``BATCH_TOL``. Looser only where the tiny folder's random VAE is
            measured to amplify float noise in the latents past it (the value's comment).
    """

    id: str
    pipeline: str
    build: Callable[[Path], Path] | None = None
    builtin: str | None = None
    request: Mapping[str, Any] = field(default_factory=dict)
    fields: Mapping[str, Any] = field(default_factory=dict)
    guided: Mapping[str, Any] = field(default_factory=dict)
    unguided: Mapping[str, Any] = field(default_factory=dict)
    variations: tuple[Mapping[str, Any], ...] = ({}, {}, {})
    backends: Mapping[str, bool] = field(default_factory=lambda: {"teacache": False, "cache_dit": False})
    video: bool = False
    channels: int = 3
    reference: str = ""
    reference_load: Callable[[Path], dict] = lambda folder: {}
    reference_call: Callable[[Any], dict] = lambda params: {}
    img2img_reference: str | None = None
    parity_atol: float = 1 / 255
    forwards: Callable[[int], int] = lambda steps: steps
    one_step: bool = True
    cuts_text: bool = True
    patch: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    input_size: tuple[int, int] = (64, 48)
    samplers: tuple[str, ...] = ("euler", "dpmpp_2m", "unipc")
    mixed_sizes: tuple[tuple[int, ...], ...] = ()
    mixed_inputs: tuple[tuple[int, int], ...] = ()
    mixed_atol: float | None = None

    @property
    def images(self) -> str:
        """``"none"``, ``"optional"`` (image-to-image) or ``"required"`` (edits)."""
        return self.fields.get("image", "none")

    def folder(self, root: Path) -> Path:
        """The model's folder: built under `root` (a fresh folder), or the built-in one."""
        if self.builtin is not None:
            from diffserve.models import BUILTIN_MODELS

            return BUILTIN_MODELS[self.builtin]
        return self.build(root)

    def params(self, seed: int = 0, **overrides: Any):
        """`SamplingParams` of a test request: `request` + `overrides` (np output by default)."""
        from diffserve import SamplingParams

        return SamplingParams(seed=seed, **{"output_type": "np", **self.request, **overrides})


def _sd3_without_t5(folder: Path) -> dict:
    return {"text_encoder_3": None, "tokenizer_3": None}


def _qwen_edit_processor(folder: Path) -> dict:
    from diffserve.pipelines.qwen_image_edit.adapter import load_qwen2vl_processor

    return {"processor": load_qwen2vl_processor(folder / "processor")}


#: Input area of the Qwen-Image-Edit tests: diffusers resizes every input image to ~1 megapixel
#: (``calculate_dimensions(1024 * 1024, ratio)``), ~9 s of tiny-VAE encode on one CPU thread;
#: the tests set that area on both sides (diffusers' module function and the adapter's
#: ``TARGET_AREA``), so the same code runs on smaller tensors.
QWEN_EDIT_TEST_AREA = 128 * 128


@contextlib.contextmanager
def qwen_edit_small_area() -> Iterator[None]:
    """Diffusers' and the adapter's Qwen-Image-Edit input area set to `QWEN_EDIT_TEST_AREA`."""
    import pytest
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit

    from diffserve.pipelines.qwen_image_edit import adapter as qwen_image_edit

    real = pipeline_qwenimage_edit.calculate_dimensions
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pipeline_qwenimage_edit, "calculate_dimensions",
                   lambda target_area, ratio: real(QWEN_EDIT_TEST_AREA, ratio))
        mp.setattr(qwen_image_edit, "TARGET_AREA", QWEN_EDIT_TEST_AREA)
        yield


def _kontext_call(params) -> dict:
    # diffserve's size rule = diffusers with max_area=height*width and _auto_resize=False
    return {"max_area": params.height * params.width, "_auto_resize": False}


_TWO_STEPS = {"num_inference_steps": 2}
#: Two double-stream and two single-stream blocks: cache-dit caches each list behind its first block.
_FLUX_BLOCKS = {"num_layers": 2, "num_single_layers": 2}
#: Every sampler: noise-prediction (epsilon / v) models offer them all.
_ALL_SAMPLERS = ("euler", "euler_a", "dpmpp_2m", "dpmpp_2m_karras", "dpmpp_sde", "ddim", "unipc", "lcm")
#: Qwen-Image and Flux Kontext pass custom sigmas to set_timesteps, which DPMSolverMultistepScheduler
#: does not take; Flux (schnell) passes mu, which DPM-Solver takes only with dynamic shifting (dev's
#: config, not schnell's).
_NO_DPM_SAMPLERS = ("euler", "unipc")
#: CFG families: per-request CFG weights and negative prompts for the batching checks.
_CFG_VARIATIONS = ({"guidance_scale": 3.0}, {"guidance_scale": 7.5, "negative_prompt": "blurry"},
                   {"guidance_scale": 5.0, "negative_prompt": "dark", "num_images_per_prompt": 2})
#: True-CFG families (Flux, Qwen-Image): per-request weights, negative prompts of different lengths.
_TRUE_CFG_VARIATIONS = ({"true_cfg_scale": 2.0, "negative_prompt": "dark"},
                        {"true_cfg_scale": 4.0, "negative_prompt": ""},
                        {"true_cfg_scale": 3.0, "negative_prompt": "a long negative prompt about many defects",
                         "num_images_per_prompt": 2})

MODELS: tuple[TestModel, ...] = (
    TestModel(
        id="StableDiffusion3Pipeline", pipeline="StableDiffusion3Pipeline", build=build_tiny_sd3,
        request={"height": 64, "width": 64, **_TWO_STEPS},
        fields={"guidance_scale": 2.0, "max_sequence_length": 64, "strength": 0.5, "image": "optional"},
        guided={"guidance_scale": 5.0, "negative_prompt": "blurry"}, unguided={"guidance_scale": 1.0},
        variations=_CFG_VARIATIONS, backends={"teacache": True, "cache_dit": True},
        reference="StableDiffusion3Pipeline", reference_load=_sd3_without_t5,
        img2img_reference="StableDiffusion3Img2ImgPipeline", input_size=(64, 64),
        parity_atol=1e-4,  # measured 2.3e-6
        mixed_sizes=((64, 64), (32, 64), (64, 48), (48, 32)),
    ),
    TestModel(
        id="StableDiffusion3Pipeline-digits", pipeline="StableDiffusion3Pipeline", builtin="digits",
        request={"height": 8, "width": 8, **_TWO_STEPS},
        fields={"guidance_scale": 2.0, "max_sequence_length": 64, "strength": 0.5, "image": "optional"},
        guided={"guidance_scale": 4.0, "negative_prompt": "the number one"}, unguided={"guidance_scale": 1.0},
        variations=_CFG_VARIATIONS, backends={"teacache": True, "cache_dit": True}, channels=1,
        reference="StableDiffusion3Pipeline", reference_load=_sd3_without_t5,
        img2img_reference="StableDiffusion3Img2ImgPipeline", input_size=(8, 8),
        parity_atol=1e-4,  # measured 2.5e-6
        mixed_sizes=((8, 8), (4, 8), (8, 6), (6, 4)),
    ),
    TestModel(
        id="FluxPipeline-schnell", pipeline="FluxPipeline",
        build=lambda out: build_tiny_flux(out, variant="schnell", **_FLUX_BLOCKS),
        request={"height": 64, "width": 48, "max_sequence_length": 32, **_TWO_STEPS},
        fields={"true_cfg_scale": 2.0, "max_sequence_length": 16},
        guided={"true_cfg_scale": 3.0, "negative_prompt": "blurry"}, unguided={},
        variations=_TRUE_CFG_VARIATIONS, backends={"teacache": True, "cache_dit": True},
        reference="FluxPipeline", parity_atol=1e-5, samplers=_NO_DPM_SAMPLERS,  # measured 0
        mixed_sizes=((64, 48), (32, 64), (64, 64), (48, 32)),
    ),
    TestModel(
        id="FluxPipeline-dev", pipeline="FluxPipeline",
        build=lambda out: build_tiny_flux(out, variant="dev", **_FLUX_BLOCKS),
        request={"height": 64, "width": 48, "max_sequence_length": 32, **_TWO_STEPS},
        fields={"guidance_scale": 2.0, "true_cfg_scale": 2.0, "max_sequence_length": 16},
        guided={"guidance_scale": 2.0, "true_cfg_scale": 3.0, "negative_prompt": "blurry"},
        unguided={"guidance_scale": 3.5},
        # embedded guidance is a per-row input: it varies inside one forward
        variations=tuple({**v, "guidance_scale": g} for v, g in zip(_TRUE_CFG_VARIATIONS, (3.5, 1.5, 6.0))),
        backends={"teacache": True, "cache_dit": True}, reference="FluxPipeline", parity_atol=1e-5,  # measured 0
        mixed_sizes=((64, 48), (48, 48), (64, 64), (32, 64)),
    ),
    TestModel(
        id="FluxKontextPipeline", pipeline="FluxKontextPipeline",
        build=lambda out: build_tiny_flux_kontext(out, **_FLUX_BLOCKS),
        request={"height": 48, "width": 64, "max_sequence_length": 32, **_TWO_STEPS},
        fields={"guidance_scale": 2.0, "true_cfg_scale": 2.0, "max_sequence_length": 16, "image": "required"},
        guided={"guidance_scale": 2.0, "true_cfg_scale": 3.0, "negative_prompt": "blurry"},
        unguided={"guidance_scale": 3.5},
        variations=tuple({**v, "guidance_scale": g} for v, g in zip(_TRUE_CFG_VARIATIONS, (3.5, 1.5, 6.0))),
        backends={"teacache": True, "cache_dit": True}, reference="FluxKontextPipeline",
        reference_call=_kontext_call, parity_atol=1e-5, samplers=_NO_DPM_SAMPLERS,  # measured 0
        mixed_sizes=((48, 64), (32, 48), (64, 64), (64, 32)),
        mixed_inputs=((64, 48), (50, 37), (32, 32), (80, 48)),  # references 64x48, 48x32, 32x32, 80x48
    ),
    TestModel(
        id="StableDiffusionPipeline", pipeline="StableDiffusionPipeline", build=build_tiny_sd15,
        request={"height": 64, "width": 64, **_TWO_STEPS},
        fields={"guidance_scale": 2.0},
        guided={"guidance_scale": 6.0, "negative_prompt": "blurry"}, unguided={"guidance_scale": 1.0},
        variations=_CFG_VARIATIONS, reference="StableDiffusionPipeline",
        parity_atol=1e-5,  # measured 0 (no cache backend: refused)
        forwards=lambda steps: steps + 1 if steps > 1 else 1,  # PNDM (PLMS warm-up): N + 1 UNet passes
        samplers=_ALL_SAMPLERS,
    ),
    TestModel(
        id="StableDiffusionXLPipeline", pipeline="StableDiffusionXLPipeline", build=build_tiny_sdxl,
        request={"height": 48, "width": 64, **_TWO_STEPS},  # non-square: other time ids
        fields={"guidance_scale": 2.0},
        guided={"guidance_scale": 6.0, "negative_prompt": "blurry"}, unguided={"guidance_scale": 1.0},
        variations=_CFG_VARIATIONS, reference="StableDiffusionXLPipeline",
        parity_atol=1e-5,  # measured 1.4e-6 (no cache backend: refused)
        samplers=_ALL_SAMPLERS,
    ),
    TestModel(
        id="QwenImagePipeline", pipeline="QwenImagePipeline", build=build_tiny_qwen_image,
        request={"height": 64, "width": 48, **_TWO_STEPS},
        fields={"true_cfg_scale": 2.0, "max_sequence_length": 16},
        guided={"true_cfg_scale": 4.0, "negative_prompt": "blurry, low quality"}, unguided={},
        variations=_TRUE_CFG_VARIATIONS, backends={"teacache": True, "cache_dit": True},
        reference="QwenImagePipeline", parity_atol=5e-4, one_step=False,  # measured 4.3e-5
        samplers=_NO_DPM_SAMPLERS,
        mixed_sizes=((64, 48), (32, 64), (64, 64), (48, 32)),
        # latents equal alone within 1.3e-6 (length groups on and off); the random VAE turns
        # that into up to 1.3e-4 in pixels (and 1.04e-4 without length groups at seeds + 300)
        mixed_atol=5e-4,
    ),
    TestModel(
        id="QwenImageEditPipeline", pipeline="QwenImageEditPipeline", build=build_tiny_qwen_image_edit,
        request={"height": 64, "width": 48, **_TWO_STEPS},
        fields={"true_cfg_scale": 2.0, "image": "required"},
        guided={"true_cfg_scale": 4.0, "negative_prompt": "blurry"}, unguided={},
        variations=_TRUE_CFG_VARIATIONS, backends={"teacache": True, "cache_dit": True},
        reference="QwenImageEditPipeline", reference_load=_qwen_edit_processor, patch=qwen_edit_small_area,
        input_size=(56, 40), parity_atol=5e-4, one_step=False, cuts_text=False,  # measured 3.4e-5
        samplers=_NO_DPM_SAMPLERS,
        mixed_sizes=((64, 48), (32, 64), (64, 64), (48, 32)),
        mixed_inputs=((56, 40), (40, 56), (64, 64), (96, 32)),  # encoded at (WxH) 160x96, 96x160, 128x128, 224x64
        mixed_atol=5e-4,  # measured 1.1e-4 (length groups), 8.1e-5 (without): the tiny VAE, as Qwen-Image
    ),
    TestModel(
        id="WanPipeline-2.1", pipeline="WanPipeline", build=build_tiny_wan,
        request={"height": 32, "width": 48, "num_frames": 5, **_TWO_STEPS},
        fields={"guidance_scale": 2.0, "max_sequence_length": 16, "num_frames": 9, "fps": 8, "num_chunks": 2},
        guided={"guidance_scale": 5.0, "negative_prompt": "blurry"}, unguided={"guidance_scale": 1.0},
        variations=_CFG_VARIATIONS, backends={"teacache": True, "cache_dit": True}, video=True,
        reference="WanPipeline", mixed_sizes=((32, 48, 5), (48, 32, 9), (16, 16, 1), (32, 32, 5)),
    ),
    TestModel(
        id="WanPipeline-2.2", pipeline="WanPipeline", build=build_tiny_wan22,
        request={"height": 32, "width": 48, "num_frames": 5, **_TWO_STEPS},
        fields={"guidance_scale": 2.0, "guidance_scale_2": 3.0, "max_sequence_length": 16, "num_frames": 9,
                "fps": 8, "num_chunks": 2},
        guided={"guidance_scale": 5.0, "guidance_scale_2": 3.0, "negative_prompt": "blurry"},
        unguided={"guidance_scale": 1.0},
        variations=tuple({**v, "guidance_scale_2": g} for v, g in zip(_CFG_VARIATIONS, (2.0, 6.0, 4.0))),
        video=True, reference="WanPipeline",  # two experts: no cache backend
        mixed_sizes=((32, 48, 5), (48, 32, 9), (16, 16, 1), (32, 32, 5)),
    ),
    TestModel(
        id="WanPipeline-digits-video", pipeline="WanPipeline", builtin="digits-video",
        request={"height": 16, "width": 16, "num_frames": 5, **_TWO_STEPS},
        fields={"guidance_scale": 2.0, "max_sequence_length": 16, "num_frames": 9, "fps": 8, "num_chunks": 2},
        guided={"guidance_scale": 4.0, "negative_prompt": "the number one"}, unguided={"guidance_scale": 1.0},
        # per-token timesteps (expand_timesteps, for first-frame conditioned streams): no cache backend
        variations=_CFG_VARIATIONS, video=True, reference="WanPipeline",
        mixed_sizes=((16, 16, 5), (16, 16, 9), (16, 16, 1), (16, 16, 5)),  # 16 px at most: frame counts mix
    ),
)

BY_ID: dict[str, TestModel] = {m.id: m for m in MODELS}


def model_ids(where: Callable[[TestModel], bool] = lambda m: True) -> list[str]:
    """Ids of the registered models for which `where` holds, in registry order."""
    return [m.id for m in MODELS if where(m)]


def uint8_levels(difference: float) -> float:
    """A pixel difference in [0, 1] units as uint8 levels."""
    return difference * 255 if math.isfinite(difference) else difference
