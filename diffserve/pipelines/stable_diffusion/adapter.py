"""Adapter for Stable Diffusion 1.x / 2.x folders (`StableDiffusionPipeline`), and the UNet
mechanics shared with SDXL (`stable_diffusion_xl/adapter.py`).

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

Per request: ``scheduler`` (a sampler of `diffserve.pipelines.samplers`: the request's own
instance of that scheduler class), ``eta`` (DDIM-type schedulers, diffusers' default 0.0) and
``clip_skip`` (diffusers' ``encode_prompt`` argument, prompt only) are request fields;
``guidance_rescale`` is diffusers' default 0.0. UNets with a guidance embedding
(``time_cond_proj_dim``, LCM-distilled) are refused at load.

Safety checker: if the folder has one (the real SD 1.5 folders do), it runs on every decoded
image exactly as in diffusers (flagged images come back black) and a warning names the
request; folders without one (``safety_checker`` null) skip it.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import torch
from diffusers import StableDiffusionPipeline
from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion import retrieve_timesteps
from diffusers.utils.torch_utils import randn_tensor

from diffserve.core.errors import UnsupportedModelError
from diffserve.pipelines.base import PipelineAdapter, RequestState, StepBatch, checked_pixels
from diffserve.pipelines.capabilities import AdapterOptions, Capabilities
from diffserve.pipelines.diffusion_scheduler import PER_REQUEST
from diffserve.pipelines.text_encoding import TextEncoder

logger = logging.getLogger(__name__)
# diffserve reports truncation itself (GenerationOutput.prompt_truncated).
logging.getLogger("diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion").setLevel(logging.ERROR)



def expose_text_model(text_encoder: Any) -> None:
    """Let diffusers 0.42.1's SD ``encode_prompt(clip_skip=...)`` run on transformers 5: it
    applies ``text_encoder.text_model.final_layer_norm``, and transformers 5's `CLIPTextModel`
    holds ``final_layer_norm`` itself (no ``text_model``). Adds a plain attribute ``text_model``
    exposing the encoder's own ``final_layer_norm`` (not a registered submodule: weights, state
    dict and module tree unchanged). No-op where ``text_model`` exists."""
    if text_encoder is not None and not hasattr(text_encoder, "text_model") \
            and hasattr(text_encoder, "final_layer_norm"):
        object.__setattr__(text_encoder, "text_model", SimpleNamespace(final_layer_norm=text_encoder.final_layer_norm))


class StableDiffusionAdapter(PipelineAdapter):
    """Step-contract adapter over a diffusers `StableDiffusionPipeline` (and the UNet base of
    the SDXL adapter).

    Tensors: latents (N, 4, H/8, W/8) in the model dtype; per CFG branch ``[negative,
    positive]`` ``encoder_hidden_states`` (N, 77, D_text); ``timestep`` (rows,) (int64 or float
    as the request's scheduler gives it; the UNet's sinusoidal embedding casts to float).
    """

    pipeline_class_name = "StableDiffusionPipeline"
    pipeline_class: type = StableDiffusionPipeline
    denoiser_name = "unet"
    # diffusers' StableDiffusionPipeline.__call__ defaults
    sampling_defaults = {"num_inference_steps": 50, "guidance_scale": 7.5}
    stepping = PER_REQUEST
    per_request_samplers = True
    #: diffusers' SDXL ``__call__`` calls ``scheduler.set_begin_index(0)``; SD's does not.
    set_begin_index = False

    @classmethod
    def pipeline_settings(cls, components: dict[str, Any], options: AdapterOptions) -> dict[str, Any]:
        """The folder's settings; without a safety checker diffusers' warning about it is noise
        (the folder decided), so ``requires_safety_checker`` follows its presence."""
        settings = super().pipeline_settings(components, options)
        if "safety_checker" in components:
            settings["requires_safety_checker"] = bool(settings.get("requires_safety_checker", True)
                                                       and components["safety_checker"] is not None)
        return settings

    def setup(self) -> dict[str, Any]:
        """Refuses guidance-embedded (LCM) UNets; CLIP encoding in batches; regional compile
        only (TeaCache and cache-dit describe DiT block stacks, not UNets)."""
        pipe = self.pipe
        if pipe.unet.config.time_cond_proj_dim is not None:
            raise UnsupportedModelError(
                f"{self.pipeline_class_name} with a guidance-embedded UNet (time_cond_proj_dim, LCM-distilled) "
                "is not supported")
        # diffusers 0.42.1 declares UNet2DConditionModel._repeated_blocks = ["BasicTransformerBlock"]
        # (the transformer blocks inside the cross-attention blocks): the default of regional compile
        self.capabilities = Capabilities()
        tokenizers = [t for t in (pipe.tokenizer, getattr(pipe, "tokenizer_2", None)) if t is not None]
        self.text = TextEncoder(self, self._encode_text, [(t, t.model_max_length) for t in tokenizers], batched=True)
        # diffusers' check_inputs: multiples of 8 (the UNet pads odd latent sizes itself)
        return {"resolution_factor": pipe.vae_scale_factor, "max_prompt_tokens": tokenizers[-1].model_max_length}

    def default_size(self) -> tuple[int, int]:
        """(height, width) in pixels when a request gives none: ``unet.config.sample_size``
        (int or [h, w]) x the VAE scale factor, as diffusers' ``__call__``."""
        size = self.pipe.unet.config.sample_size
        h, w = (size, size) if isinstance(size, int) else size
        f = self.pipe.vae_scale_factor
        return h * f, w * f

    # ---------------------------------------------------------------- per request
    def max_clip_skip(self) -> int | None:
        expose_text_model(self.pipe.text_encoder)
        return self.clip_layers_skippable(self.pipe.text_encoder)

    def _encode_text(self, text: str | list[str], max_sequence_length: int | None, clip_skip: int | None = None):
        """diffusers' SD encoding of a text (or of n texts, a row each: CLIP pads to 77
        tokens, so a row equals the text alone), with `clip_skip`: prompt_embeds (n, 77, D_text)."""
        pe, _ = self.pipe.encode_prompt(text, self.device, 1, False, clip_skip=clip_skip)
        return (pe,)

    def prepare_request(self, state: RequestState) -> None:
        """Encode the texts (through the cache), create the request's own scheduler and its
        timesteps (PNDM with ``skip_prk_steps``: N steps give N + 1 UNet passes, as in
        diffusers), draw latents (N, 4, H/8, W/8) from the request's generator times the
        scheduler's ``init_noise_sigma`` (diffusers' ``prepare_latents``), and the step keyword
        arguments (`stepping`, as diffusers' ``prepare_extra_step_kwargs``: eta, the request's
        generator)."""
        p, pipe = state.params, self.pipe
        state.branches = self.text_branches(state)
        scheduler = self.request_scheduler(p)
        timesteps, _ = retrieve_timesteps(scheduler, p.num_inference_steps, self.device)
        if self.set_begin_index and hasattr(scheduler, "set_begin_index"):
            scheduler.set_begin_index(0)
        f = pipe.vae_scale_factor
        shape = (p.num_images_per_prompt, pipe.unet.config.in_channels, p.height // f, p.width // f)
        dtype = state.branches[-1]["encoder_hidden_states"].dtype
        latents = randn_tensor(shape, generator=state.generator, device=self.device, dtype=dtype)
        state.latents = latents * scheduler.init_noise_sigma
        self.set_schedule(state, scheduler, timesteps)

    # ------------------------------------------------------------------ per step
    def forward_inputs(self, batch: StepBatch) -> dict[str, Any]:
        """The UNet's arguments: ``sample`` (rows, 4, h, w) (each request's
        ``scheduler.scale_model_input``, `stepping`), ``timestep`` (rows,),
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
