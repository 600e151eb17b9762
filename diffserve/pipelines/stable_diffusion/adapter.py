"""Adapter for Stable Diffusion 1.x / 2.x folders (`StableDiffusionPipeline`), and the UNet
mechanics shared with SDXL (`stable_diffusion_xl.py`).

Latent diffusion (Rombach et al. 2022, "High-Resolution Image Synthesis with Latent Diffusion
Models", arXiv:2112.10752): a `UNet2DConditionModel` predicting noise (epsilon, SD 1.x / 2.x
base) or v (Salimans & Ho 2022, SD 2.x-v), a CLIP text encoder, an `AutoencoderKL`, and a
classic discrete-time diffusion scheduler: PNDM (the SD 1.5 default), DDIM, Euler, Euler
ancestral, DPM-Solver++ multistep, ... whichever the folder's ``scheduler/`` holds.

Every request gets its own instance of that scheduler (`new_scheduler`), so stateful
multistep schedulers keep their history per request and requests with different step counts
share UNet forwards; the step is the scheduler's own ``step`` per request (the batched
flow-matching path does not apply: ``RequestState.sigmas`` stays None). The UNet input is
``scheduler.scale_model_input(latents, t)`` per request and the timestep a (rows,) tensor.
Prompt encoding, timesteps, step keyword arguments (``eta``, the request's ``generator`` for
ancestral schedulers), the safety checker and post-processing are diffusers' own
`StableDiffusionPipeline` methods on the same components, so an image equals diffusers' for
the same seed (tests/pipelines/test_stable_diffusion.py).

Differences from diffusers' ``__call__`` arguments: ``eta`` is its default 0.0,
``guidance_rescale`` 0.0 and ``clip_skip`` None (none are request fields). UNets with a
guidance embedding (``time_cond_proj_dim``, LCM-distilled) are refused at load.

Safety checker: if the folder has one (the real SD 1.5 folders do), it runs on every decoded
image exactly as in diffusers (flagged images come back black) and a warning names the
request; folders without one (``safety_checker`` null) skip it.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from diffusers import StableDiffusionPipeline
from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion import retrieve_timesteps
from diffusers.utils.torch_utils import randn_tensor

from diffserve.core.errors import UnsupportedModelError
from diffserve.pipelines.base import (
    AdapterOptions,
    Capabilities,
    PipelineAdapter,
    RequestState,
    StepBatch,
    checked_pixels,
)
from diffserve.pipelines.diffusion_scheduler import new_scheduler
from diffserve.pipelines.generation_config import read_generation_config
from diffserve.pipelines.text_encoding import TextEncoder, repeat_rows
from diffserve.core.sampling_params import ModelSpec, SamplingParams

logger = logging.getLogger(__name__)
# diffserve reports truncation itself (GenerationOutput.prompt_truncated).
logging.getLogger("diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion").setLevel(logging.ERROR)

# diffusers' StableDiffusionPipeline.__call__ defaults.
DEFAULT_NUM_INFERENCE_STEPS = 50
DEFAULT_GUIDANCE_SCALE = 7.5
#: ``eta`` of DDIM-type schedulers (diffusers' __call__ default; not a request field).
ETA = 0.0


class StableDiffusionAdapter(PipelineAdapter):
    """Step-contract adapter over a diffusers `StableDiffusionPipeline` (and the UNet base of
    the SDXL adapter).

    Tensors: latents (N, 4, H/8, W/8) in the model dtype; per CFG branch ``[negative,
    positive]`` ``encoder_hidden_states`` (N, 77, D_text); ``timestep`` (rows,) (int64 or float
    as the request's scheduler gives it; the UNet's sinusoidal embedding casts to float).
    """

    pipeline_class_name = "StableDiffusionPipeline"
    pipeline_class: type = StableDiffusionPipeline
    default_guidance_scale = DEFAULT_GUIDANCE_SCALE
    #: diffusers' SDXL ``__call__`` calls ``scheduler.set_begin_index(0)``; SD's does not.
    set_begin_index = False

    def __init__(self, pipe: Any, device: torch.device, dtype: torch.dtype, options: AdapterOptions):
        self.pipe = pipe
        self.device = device
        self.dtype = dtype
        if pipe.unet.config.time_cond_proj_dim is not None:
            raise UnsupportedModelError(
                f"{self.pipeline_class_name} with a guidance-embedded UNet (time_cond_proj_dim, LCM-distilled) "
                "is not supported")
        config = read_generation_config(options.model_dir)
        height, width = self.default_size()
        self.spec = ModelSpec(
            pipeline=self.pipeline_class_name,
            # diffusers' check_inputs: multiples of 8 (the UNet pads odd latent sizes itself)
            resolution_factor=pipe.vae_scale_factor,
            default_height=int(config.get("height", height)),
            default_width=int(config.get("width", width)),
            default_num_inference_steps=int(config.get("num_inference_steps", DEFAULT_NUM_INFERENCE_STEPS)),
            default_guidance_scale=float(config.get("guidance_scale", self.default_guidance_scale)),
            text_conditioned=True,
            max_prompt_tokens=self.tokenizers()[-1].model_max_length,
        )
        # TeaCache and cache-dit describe DiT block stacks, not UNets: both refused (None).
        # Regional compile: diffusers 0.42.1 declares UNet2DConditionModel._repeated_blocks =
        # ["BasicTransformerBlock"] (the transformer blocks inside the cross-attention blocks).
        self.capabilities = Capabilities(repeated_blocks=tuple(getattr(pipe.unet, "_repeated_blocks", None) or ()))
        self.text = TextEncoder(self, self._encode_text,
                                [(t, t.model_max_length) for t in self.tokenizers()], batched=True)

    @classmethod
    def from_components(cls, components, device, dtype, options):
        from diffserve.models.model_index import pipeline_config

        extra = pipeline_config(options.model_dir)
        components = {**components}
        for optional in ("safety_checker", "feature_extractor", "image_encoder"):
            components.setdefault(optional, None)
        # without a checker, diffusers' warning about it is noise: the folder decided
        extra["requires_safety_checker"] = bool(extra.get("requires_safety_checker", True)
                                                and components["safety_checker"] is not None)
        return cls.build(components, device, dtype, options, extra)

    @classmethod
    def build(cls, components: dict[str, Any], device: torch.device, dtype: torch.dtype,
              options: AdapterOptions, extra: dict[str, Any]) -> "StableDiffusionAdapter":
        """Construct the diffusers pipeline (its ``__init__`` fixes outdated scheduler configs,
        as ``from_pretrained`` would) with the model_index entries it accepts, move it to
        `device`, wrap it."""
        import inspect

        accepted = inspect.signature(cls.pipeline_class.__init__).parameters
        pipe = cls.pipeline_class(**components, **{k: v for k, v in extra.items() if k in accepted})
        pipe.to(device)
        pipe.set_progress_bar_config(disable=True)
        return cls(pipe, device, dtype, options)

    @property
    def denoiser(self) -> torch.nn.Module:
        return self.pipe.unet

    def tokenizers(self) -> list[Any]:
        """The CLIP tokenizers whose limit (77) truncates a prompt."""
        return [self.pipe.tokenizer]

    def default_size(self) -> tuple[int, int]:
        """(height, width) in pixels when a request gives none: ``unet.config.sample_size``
        (int or [h, w]) x the VAE scale factor, as diffusers' ``__call__``."""
        size = self.pipe.unet.config.sample_size
        h, w = (size, size) if isinstance(size, int) else size
        f = self.pipe.vae_scale_factor
        return h * f, w * f

    # ---------------------------------------------------------------- per request
    def _encode_text(self, text: str | list[str], max_sequence_length: int | None):
        """diffusers' SD encoding of a text (or of n texts, a row each: CLIP pads to 77
        tokens, so a row equals the text alone): prompt_embeds (n, 77, D_text)."""
        pe, _ = self.pipe.encode_prompt(text, self.device, 1, False)
        return (pe,)

    def texts_to_encode(self, prompt: str, params: SamplingParams) -> list[tuple[str, int | None]]:
        """The prompt and, with CFG, ``negative_prompt or ""``; CLIP's fixed 77 tokens (no
        max_sequence_length)."""
        return [(text, None) for text, _ in super().texts_to_encode(prompt, params)]

    def branch_inputs(self, state: RequestState) -> list[dict[str, Any]]:
        """Per CFG branch (negative first) the UNet's text inputs, N rows each: diffusers'
        negative is ``negative_prompt or ""``."""
        p = state.params
        texts = [p.negative_prompt or "", state.prompt] if self.branches(p) == 2 else [state.prompt]
        return [{"encoder_hidden_states": repeat_rows(self.text.encode(t)[0], p.num_images_per_prompt)}
                for t in texts]

    def prepare_request(self, state: RequestState) -> None:
        """Encode the texts (through the cache), create the request's own scheduler and its
        timesteps (PNDM with ``skip_prk_steps``: N steps give N + 1 UNet passes, as in
        diffusers), draw latents (N, 4, H/8, W/8) from the request's generator times the
        scheduler's ``init_noise_sigma`` (diffusers' ``prepare_latents``), and the step keyword
        arguments (diffusers' ``prepare_extra_step_kwargs``: eta, the request's generator)."""
        p = state.params
        pipe = self.pipe
        state.branches = self.branch_inputs(state)
        state.guidance_scale = p.guidance_scale
        scheduler = new_scheduler(pipe.scheduler)
        timesteps, _ = retrieve_timesteps(scheduler, p.num_inference_steps, self.device)
        if self.set_begin_index and hasattr(scheduler, "set_begin_index"):
            scheduler.set_begin_index(0)
        f = pipe.vae_scale_factor
        shape = (p.num_images_per_prompt, pipe.unet.config.in_channels, p.height // f, p.width // f)
        dtype = state.branches[-1]["encoder_hidden_states"].dtype
        latents = randn_tensor(shape, generator=state.generator, device=self.device, dtype=dtype)
        state.latents = latents * scheduler.init_noise_sigma
        state.scheduler = scheduler
        state.timesteps = timesteps
        state.sigmas = None  # the scheduler's own step, per request
        # reads only the scheduler class's `step` signature: the template's is the request's
        state.step_kwargs = pipe.prepare_extra_step_kwargs(state.generator, ETA)

    # ------------------------------------------------------------------ per step
    def model_input(self, state: RequestState) -> torch.Tensor:
        """``scheduler.scale_model_input(latents, t)`` with the request's scheduler (identity
        for PNDM / DDIM / DPM-Solver, ``x / sqrt(sigma^2 + 1)`` for Euler types); diffusers
        scales the CFG-doubled input, equal per row."""
        return state.scheduler.scale_model_input(state.latents, state.timestep)

    def denoise_kwargs(self, batch: StepBatch) -> dict[str, Any]:
        """The UNet's arguments: ``sample`` (rows, 4, h, w), ``timestep`` (rows,),
        ``encoder_hidden_states`` (rows, 77, D) and, for SDXL, ``added_cond_kwargs``."""
        kwargs = dict(batch.inputs)
        kwargs["sample"] = kwargs.pop("hidden_states")
        return kwargs

    # ------------------------------------------------------------------ decode
    def decode(self, state: RequestState, latents: torch.Tensor | None = None) -> Any:
        """``vae.decode(latents / scaling_factor)``, the safety checker if the folder has one,
        ``image_processor.postprocess`` to the request's output_type."""
        latents = state.latents if latents is None else latents
        output_type = state.params.output_type
        if output_type == "latent":
            return latents
        pipe = self.pipe
        image = checked_pixels(self.vae_decode(latents))
        denormalize = None
        if getattr(pipe, "safety_checker", None) is not None:
            image, nsfw = pipe.run_safety_checker(image, self.device, self.dtype)
            denormalize = [not flagged for flagged in nsfw]
            if any(nsfw):
                logger.warning("%s: the safety checker blacked out image(s) %s", state.request_id,
                               [i for i, flagged in enumerate(nsfw) if flagged])
        return pipe.image_processor.postprocess(image, output_type=output_type, do_denormalize=denormalize)

    def vae_decode(self, latents: torch.Tensor) -> torch.Tensor:
        """(N, 3, H, W) pixels in [-1, 1] from (N, 4, h, w) latents."""
        vae = self.pipe.vae
        return vae.decode((latents / vae.config.scaling_factor).to(vae.dtype), return_dict=False)[0]
