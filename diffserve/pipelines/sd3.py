"""Adapter for the Stable Diffusion 3 family (`StableDiffusion3Pipeline` folders).

SD3 / SD3.5 (Esser et al. 2024, "Scaling Rectified Flow Transformers", arXiv:2403.03206):
an MMDiT `SD3Transformer2DModel`, two CLIP text encoders plus an optional T5, an
`AutoencoderKL` and a `FlowMatchEulerDiscreteScheduler`. Prompt encoding, latent preparation
and timesteps reuse diffusers' own `StableDiffusion3Pipeline` methods on the same components,
so an image equals diffusers' for the same seed (see tests/test_parity.py).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Hashable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from diffusers import StableDiffusion3Pipeline
from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import (
    calculate_shift,
    retrieve_timesteps,
)

from diffserve.pipelines.base import PipelineAdapter, RequestState
from diffserve.sampling_params import ModelSpec, SamplingParams

if TYPE_CHECKING:
    from diffserve.runner.step_batch import StepBatch

# diffserve reports truncation itself (GenerationOutput.prompt_truncated); diffusers' own warning
# echoes the whole cut text on every encode.
logging.getLogger("diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3").setLevel(logging.ERROR)

# diffusers' StableDiffusion3Pipeline.__call__ defaults.
DEFAULT_NUM_INFERENCE_STEPS = 28
DEFAULT_GUIDANCE_SCALE = 7.0
MAX_SEQUENCE_LENGTH = 256
GENERATION_CONFIG = "generation_config.json"


def read_generation_config(model_dir: Path) -> dict[str, Any]:
    """Optional per-model sampling defaults shipped in ``<model>/generation_config.json``
    (keys: num_inference_steps, guidance_scale, height, width); {} when absent."""
    path = Path(model_dir) / GENERATION_CONFIG
    if not path.is_file():
        return {}
    return json.loads(path.read_text())


class StableDiffusion3Adapter(PipelineAdapter):
    """Step-contract adapter over a diffusers `StableDiffusion3Pipeline`.

    Tensors: latents (N, C_latent, H/f_vae, W/f_vae); prompt_embeds
    (rows, L_clip + max_sequence_length, joint_attention_dim); pooled (rows, pooled_dim);
    all in the model dtype. CFG rows are ordered [negative..., positive...] as in diffusers.
    """

    pipeline_class_name = "StableDiffusion3Pipeline"

    def __init__(self, pipe: StableDiffusion3Pipeline, device: torch.device, dtype: torch.dtype,
                 generation_config: dict[str, Any]):
        self.pipe = pipe
        self.device = device
        self.dtype = dtype
        self.max_sequence_length = MAX_SEQUENCE_LENGTH
        self.context_folding = False
        vae_factor = pipe.vae_scale_factor
        pos_max = pipe.transformer.config.get("pos_embed_max_size")
        max_side = None if pos_max is None else pos_max * pipe.patch_size * vae_factor
        self.spec = ModelSpec(
            resolution_factor=vae_factor * pipe.patch_size,
            default_height=int(generation_config.get("height", pipe.default_sample_size * vae_factor)),
            default_width=int(generation_config.get("width", pipe.default_sample_size * vae_factor)),
            default_num_inference_steps=int(
                generation_config.get("num_inference_steps", DEFAULT_NUM_INFERENCE_STEPS)
            ),
            default_guidance_scale=float(generation_config.get("guidance_scale", DEFAULT_GUIDANCE_SCALE)),
            text_conditioned=True,
            max_prompt_tokens=pipe.tokenizer_max_length,
            # PatchEmbed crops a pos_embed_max_size^2 grid of positions: larger inputs fail
            max_height=max_side,
            max_width=max_side,
        )

    @classmethod
    def from_components(cls, components, device, dtype, model_dir):
        components = {**components}
        for optional in ("text_encoder_3", "tokenizer_3", "image_encoder", "feature_extractor"):
            components.setdefault(optional, None)
        pipe = StableDiffusion3Pipeline(**components)
        pipe.to(device)
        pipe.set_progress_bar_config(disable=True)
        return cls(pipe, device, dtype, read_generation_config(model_dir))

    @property
    def denoiser(self) -> torch.nn.Module:
        return self.pipe.transformer

    @property
    def text_seq_len(self) -> int:
        """Text tokens per row: CLIP tokens + T5 tokens (zeros when no T5; one folded token
        when context folding is on)."""
        t5_tokens = 1 if self.context_folding else self.max_sequence_length
        return self.pipe.tokenizer_max_length + t5_tokens

    def enable_context_folding(self) -> bool:
        """Without T5, run the 256 zero placeholder rows as one folded token (same image
        within float rounding, far fewer tokens; see `acceleration.context_folding`)."""
        if self.pipe.text_encoder_3 is not None:
            return False
        from diffserve.acceleration.context_folding import install_folded_context_attention

        install_folded_context_attention(self.pipe.transformer, self.max_sequence_length)
        self.context_folding = True
        return True

    def batch_key(self, params: SamplingParams) -> Hashable:
        """(pipeline, latent height, latent width, CFG on/off, text tokens, dtype)."""
        f = self.pipe.vae_scale_factor
        return (
            self.pipeline_class_name,
            params.height // f,
            params.width // f,
            params.do_classifier_free_guidance,
            self.text_seq_len,
            self.dtype,
        )

    def prompt_is_truncated(self, prompt: str) -> bool:
        """Whether any tokenizer's ids for `prompt` exceed its limit (CLIP: model_max_length;
        T5: max_sequence_length). Tokenizers are not thread-safe: call on the engine thread."""
        pipe = self.pipe
        for tokenizer, limit in (
            (pipe.tokenizer, pipe.tokenizer_max_length),
            (pipe.tokenizer_2, pipe.tokenizer_max_length),
            (pipe.tokenizer_3, self.max_sequence_length),
        ):
            if tokenizer is not None and len(tokenizer(prompt).input_ids) > limit:
                return True
        return False

    def encode_prompt(self, prompt: str, negative_prompt: str, do_cfg: bool, num_images: int):
        """diffusers' SD3 prompt encoding for one request.

        Returns:
            (prompt_embeds, pooled_prompt_embeds): (rows, L, D) and (rows, P), rows =
            num_images x (2 if CFG), negative rows first.
        """
        pe, npe, pooled, npooled = self.pipe.encode_prompt(
            prompt=prompt,
            prompt_2=None,
            prompt_3=None,
            negative_prompt=negative_prompt if do_cfg else None,
            do_classifier_free_guidance=do_cfg,
            num_images_per_prompt=num_images,
            device=self.device,
            max_sequence_length=self.max_sequence_length,
        )
        if do_cfg:
            pe = torch.cat([npe, pe], dim=0)
            pooled = torch.cat([npooled, pooled], dim=0)
        if self.context_folding:
            from diffserve.acceleration.context_folding import fold_placeholder_rows

            pe = fold_placeholder_rows(pe, self.pipe.tokenizer_max_length)
        return pe, pooled

    def cached_encode_prompt(self, prompt: str, negative_prompt: str, do_cfg: bool, num_images: int):
        """`encode_prompt` through the prompt-embedding cache when the runner installed one
        (keyed by every argument that changes the result); same return value."""
        if self.prompt_embed_cache is None:
            return self.encode_prompt(prompt, negative_prompt, do_cfg, num_images)
        key = (prompt, negative_prompt if do_cfg else None, do_cfg, num_images,
               self.max_sequence_length, self.text_seq_len, str(self.dtype), str(self.device))
        return self.prompt_embed_cache.get_or_encode(
            key, lambda: self.encode_prompt(prompt, negative_prompt, do_cfg, num_images))

    def prepare(self, state: RequestState) -> None:
        """Encode the prompt (through the prompt-embedding cache), seed the request's CPU
        generator, draw latents (N, C, H/f, W/f) exactly as diffusers does, and create the
        request's own diffusion scheduler with its (num_inference_steps,) timesteps."""
        p = state.params
        do_cfg = p.do_classifier_free_guidance
        prompt_embeds, pooled = self.cached_encode_prompt(
            state.prompt, p.negative_prompt or "", do_cfg, p.num_images_per_prompt
        )
        state.model_inputs = {"encoder_hidden_states": prompt_embeds, "pooled_projections": pooled}
        state.generator = torch.Generator(device="cpu").manual_seed(p.seed)
        state.latents = self.pipe.prepare_latents(
            p.num_images_per_prompt,
            self.pipe.transformer.config.in_channels,
            p.height,
            p.width,
            prompt_embeds.dtype,
            self.device,
            state.generator,
        )
        scheduler = type(self.pipe.scheduler).from_config(self.pipe.scheduler.config)
        kwargs = {}
        if scheduler.config.get("use_dynamic_shifting", None):
            patch = self.pipe.transformer.config.patch_size
            _, _, h, w = state.latents.shape
            kwargs["mu"] = calculate_shift(
                (h // patch) * (w // patch),
                scheduler.config.get("base_image_seq_len", 256),
                scheduler.config.get("max_image_seq_len", 4096),
                scheduler.config.get("base_shift", 0.5),
                scheduler.config.get("max_shift", 1.16),
            )
        timesteps, _ = retrieve_timesteps(scheduler, p.num_inference_steps, self.device, **kwargs)
        state.scheduler = scheduler
        state.timesteps = timesteps
        state.step_index = 0

    def step_inputs(self, state: RequestState) -> dict[str, torch.Tensor]:
        """Rows of this request: hidden_states (rows, C, h, w) (latents twice with CFG),
        timestep (rows,) = this request's current timestep, its prompt embeddings."""
        latents = state.latents
        if state.params.do_classifier_free_guidance:
            latents = torch.cat([latents, latents], dim=0)
        t = state.timesteps[state.step_index].expand(latents.shape[0])
        return {"hidden_states": latents, "timestep": t, **state.model_inputs}

    def denoise(self, batch: "StepBatch") -> torch.Tensor:
        """One `SD3Transformer2DModel` forward; returns the velocity prediction
        (total_rows, C, h, w) in the model dtype."""
        return self.pipe.transformer(**batch.inputs, return_dict=False)[0]

    def step(self, state: RequestState, noise_pred: torch.Tensor) -> None:
        """CFG (uncond + scale * (cond - uncond), Ho & Salimans 2022) on this request's rows,
        then one step of its own flow-matching Euler scheduler."""
        p = state.params
        if p.do_classifier_free_guidance:
            uncond, cond = noise_pred.chunk(2)
            noise_pred = uncond + p.guidance_scale * (cond - uncond)
        t = state.timesteps[state.step_index]
        state.latents = state.scheduler.step(noise_pred, t, state.latents, return_dict=False)[0]
        state.step_index += 1

    def decode(self, state: RequestState, latents: torch.Tensor | None = None) -> Any:
        """Unscale (latents / scaling_factor + shift_factor), VAE-decode and post-process to
        the request's output_type (PIL list, float32 (N, H, W, C) array in [0, 1], ...)."""
        latents = state.latents if latents is None else latents
        output_type = state.params.output_type
        if output_type == "latent":
            return latents
        vae = self.pipe.vae
        latents = latents / vae.config.scaling_factor + (vae.config.shift_factor or 0.0)
        image = vae.decode(latents.to(vae.dtype), return_dict=False)[0]
        return self.pipe.image_processor.postprocess(image, output_type=output_type)
