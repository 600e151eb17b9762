"""Step adapter of GLM-Image (`GlmImagePipeline` folders): the DiT stage.

The AR stage (`ar_stage.GlmImageARStage`) hands each request's prior image tokens through the
connector (``RequestState.context["cond"]``). Per guidance branch (the unconditional one first,
with ``guidance_scale > 1``): ``encoder_hidden_states`` = the glyph embeddings (T5 over the
prompt's quoted text; of ``""`` for the unconditional branch), ``prior_token_drop`` (all False /
all True); per row, both branches: ``prior_token_id``, ``target_size`` and ``crop_coords``.
Glyph embeddings of different lengths are right-padded with a boolean key mask
(`glyph_attention`), so requests with and without quoted text share forwards.

Timesteps, latents, the ``timestep - 1`` the DiT receives, CFG and the decode are
`GlmImagePipeline.__call__`'s (text-to-image; image-to-image is not served).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from diffusers import GlmImagePipeline
from diffusers.pipelines.glm_image.pipeline_glm_image import calculate_shift, retrieve_timesteps

from diffserve.core.errors import InvalidRequestError
from diffserve.core.sampling_params import SamplingParams
from diffserve.pipelines.base import PipelineAdapter, RequestState, StepBatch, checked_pixels
from diffserve.pipelines.diffusion_scheduler import new_scheduler
from diffserve.pipelines.glm_image.ar_stage import GlmImageARStage
from diffserve.pipelines.glm_image.glyph_attention import install_masked_glyph_attention
from diffserve.pipelines.text_encoding import repeat_rows

#: GlmImagePipeline.__call__'s glyph text budget.
DEFAULT_MAX_SEQUENCE_LENGTH = 2048


class GlmImageAdapter(PipelineAdapter):
    """The DiT stage of GLM-Image (see the module docstring).

    Tensors: latents (N, C, H/8, W/8); per branch ``encoder_hidden_states`` (N, L_glyph, D_t5) and
    ``prior_token_drop`` (N, 4 h w) bool, ``prior_token_id`` (N, 4 h w) int64, ``target_size`` /
    ``crop_coords`` (N, 2).
    """

    pipeline_class_name = "GlmImagePipeline"
    pipeline_class = GlmImagePipeline
    ar_stage_components = ("vision_language_encoder", "processor")
    optional_components = ar_stage_components  # built without them: the AR stage has its own runner
    # GlmImagePipeline.__call__ defaults
    sampling_defaults = {"height": 1024, "width": 1024, "num_inference_steps": 50, "guidance_scale": 1.5}
    #: glyph embeddings of different lengths: right-padded with a key mask (`glyph_attention`)
    padded_inputs = {"encoder_hidden_states": ("glyph_mask", 0.0)}

    def setup(self) -> dict[str, Any]:
        """The masked glyph attention; sizes in multiples of the prior tokens' grid."""
        install_masked_glyph_attention(self.pipe.transformer)
        return {"resolution_factor": self.pipe.vae_scale_factor * self.pipe.transformer.config.patch_size * 2}

    @classmethod
    def build_ar_stage(cls, components: dict[str, Any], device: torch.device, dtype: torch.dtype):
        return GlmImageARStage(components["vision_language_encoder"].to(device), components["processor"])

    def context_branches(self, params: SamplingParams) -> tuple[str, ...]:
        """The prior tokens (``"cond"``); the unconditional branch drops them, so needs no payload."""
        return ("cond",)

    def check_params(self, params: SamplingParams, inputs) -> None:
        """Text-to-image only; no negative prompt (GLM-Image's unconditional branch is fixed:
        the glyphs of ``""`` and the prior tokens dropped, as in diffusers)."""
        super().check_params(params, inputs)
        if params.negative_prompt is not None:
            raise InvalidRequestError("negative_prompt", params.negative_prompt,
                                      "unset: GLM-Image's unconditional branch takes no negative prompt")

    def _glyph(self, text: str) -> torch.Tensor:
        return self.pipe._get_glyph_embeds([text], DEFAULT_MAX_SEQUENCE_LENGTH, self.device, self.dtype)

    def prepare_request(self, state: RequestState) -> None:
        """Per branch the glyph embeddings and the prior tokens (dropped on the unconditional
        one), latents and the schedule exactly as `GlmImagePipeline.__call__` draws them."""
        p = state.params
        n = p.num_images_per_prompt
        pipe = self.pipe
        prior = state.context["cond"].tensors["prior_token_ids"].to(self.device)[None]
        prior = repeat_rows(prior, n)
        size = torch.tensor([[p.height, p.width]], dtype=self.dtype, device=self.device).repeat(n, 1)
        crop = torch.zeros((n, 2), dtype=self.dtype, device=self.device)
        # (text, prior tokens dropped): the unconditional branch first with CFG
        texts = [("", True), (state.prompt, False)] if self.branches(p) == 2 else [(state.prompt, False)]
        branches = []
        for text, dropped in texts:
            drop = torch.full_like(prior, dropped, dtype=torch.bool)
            branches.append({"encoder_hidden_states": repeat_rows(self._glyph(text), n), "prior_token_drop": drop,
                             "prior_token_id": prior, "target_size": size, "crop_coords": crop})
        state.branches = branches
        state.latents = pipe.prepare_latents(n, pipe.transformer.config.in_channels, p.height, p.width, self.dtype,
                                             self.device, state.generator)
        scheduler = new_scheduler(pipe.scheduler)
        seq_len = (p.height // pipe.vae_scale_factor) * (p.width // pipe.vae_scale_factor) \
            // pipe.transformer.config.patch_size ** 2
        steps = p.num_inference_steps
        timesteps = np.linspace(scheduler.config.num_train_timesteps, 1.0, steps + 1)[:-1]
        timesteps = timesteps.astype(np.int64).astype(np.float32)
        sigmas = timesteps / scheduler.config.num_train_timesteps
        mu = calculate_shift(seq_len, scheduler.config.get("base_image_seq_len", 256),
                             scheduler.config.get("base_shift", 0.25), scheduler.config.get("max_shift", 0.75))
        timesteps, _ = retrieve_timesteps(scheduler, steps, self.device, timesteps, sigmas, mu=mu)
        self.set_schedule(state, scheduler, timesteps)

    def forward_inputs(self, batch: StepBatch) -> dict[str, Any]:
        """The glyph mask goes to the attention processors; the DiT takes ``timestep - 1``."""
        inputs = dict(batch.inputs)
        mask = inputs.pop("glyph_mask", None)
        inputs["attention_kwargs"] = {"glyph_mask": mask} if mask is not None else None
        inputs["timestep"] = inputs["timestep"] - 1
        return inputs

    def call_denoiser(self, batch: StepBatch, kwargs: dict[str, Any]) -> torch.Tensor:
        """The transformer's prediction in float32 (as diffusers' loop casts it)."""
        return self.denoiser(**kwargs, return_dict=False)[0].float()

    def decode(self, state: RequestState, latents: torch.Tensor | None = None) -> Any:
        latents = state.latents if latents is None else latents
        if state.params.output_type == "latent":
            return latents
        vae = self.pipe.vae
        shape = (1, vae.config.latent_channels, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents.device, latents.dtype)
        std = torch.tensor(vae.config.latents_std).view(shape).to(latents.device, latents.dtype)
        image = vae.decode(latents.to(vae.dtype) * std + mean, return_dict=False)[0]
        return self.pipe.image_processor.postprocess(checked_pixels(image), output_type=state.params.output_type)


__all__ = ["GlmImageAdapter"]
