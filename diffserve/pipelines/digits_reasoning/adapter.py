"""Step adapter of `digits-reasoning` (`DigitsReasoningPipeline` folders): the DiT stage.

The AR stage (`ar_stage.DigitsReasoningARStage`) hands each request's K/V through the
connector; the runner puts the received payloads in ``RequestState.context`` before `prepare`.
Per guidance branch (``"negative"`` then ``"cond"`` with CFG), the branch input ``ar_kv`` is the
LM's K/V (rows, L, layers, 2, H, D). Requests whose contexts differ in length share forwards:
``ar_kv`` is right-padded to the batch's longest and ``ar_kv_mask`` (rows, L) marks the real
tokens (`pad_keys`), so each row equals its solo forward. Prompt encoding, latents, timesteps,
CFG and decode are the reference `DigitsReasoningPipeline.__call__`'s.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import retrieve_timesteps
from diffusers.utils.torch_utils import randn_tensor

from diffserve.core.errors import InvalidRequestError
from diffserve.pipelines.base import AdapterOptions, PipelineAdapter, RequestState, StepBatch, checked_pixels
from diffserve.pipelines.diffusion_scheduler import batchable_sigmas, new_scheduler
from diffserve.pipelines.digits_reasoning.ar_stage import DigitsReasoningARStage, uses_cfg
from diffserve.pipelines.digits_reasoning.pipeline import DigitsReasoningPipeline
from diffserve.pipelines.generation_config import read_generation_config
from diffserve.pipelines.text_encoding import repeat_rows
from diffserve.core.sampling_params import ModelSpec, SamplingParams

#: DigitsReasoningPipeline.__call__ defaults.
DEFAULT_NUM_INFERENCE_STEPS = 20
DEFAULT_GUIDANCE_SCALE = 4.0


class DigitsReasoningAdapter(PipelineAdapter):
    """The DiT stage of `digits-reasoning` (see the module docstring).

    Tensors: latents (N, 1, 8, 8); per branch ``ar_kv`` (N, L, layers, 2, H, D),
    ``encoder_hidden_states`` (N, 1, J) and ``pooled_projections`` (N, P) zeros, model dtype.
    """

    pipeline_class_name = "DigitsReasoningPipeline"
    ar_stage_components = ("language_model", "tokenizer")

    def __init__(self, pipe: DigitsReasoningPipeline, device: torch.device, dtype: torch.dtype,
                 options: AdapterOptions):
        self.pipe = pipe
        self.device = device
        self.dtype = dtype
        config = read_generation_config(options.model_dir)
        transformer = pipe.transformer.config
        side = transformer.sample_size * pipe.vae_scale_factor
        max_side = transformer.pos_embed_max_size * transformer.patch_size * pipe.vae_scale_factor
        self.spec = ModelSpec(
            pipeline=self.pipeline_class_name,
            resolution_factor=pipe.vae_scale_factor * transformer.patch_size,
            default_height=int(config.get("height", side)),
            default_width=int(config.get("width", side)),
            default_num_inference_steps=int(config.get("num_inference_steps", DEFAULT_NUM_INFERENCE_STEPS)),
            default_guidance_scale=float(config.get("guidance_scale", DEFAULT_GUIDANCE_SCALE)),
            text_conditioned=True,
            max_height=max_side,
            max_width=max_side,
        )

    @classmethod
    def from_components(cls, components, device, dtype, options):
        components = {**components}
        for name in cls.ar_stage_components:
            components.setdefault(name, None)
        pipe = DigitsReasoningPipeline(**components)
        pipe.to(device)
        pipe.set_progress_bar_config(disable=True)
        return cls(pipe, device, dtype, options)

    @classmethod
    def build_ar_stage(cls, components: dict[str, Any], device: torch.device, dtype: torch.dtype):
        """The AR stage model from the ``language_model`` and ``tokenizer`` components."""
        lm = components["language_model"].to(device)
        return DigitsReasoningARStage(lm, components["tokenizer"])

    @property
    def denoiser(self) -> torch.nn.Module:
        return self.pipe.transformer

    def context_branches(self, params: SamplingParams) -> tuple[str, ...]:
        """The payload branches a request needs: ``("negative", "cond")`` with CFG, else ``("cond",)``."""
        return ("negative", "cond") if uses_cfg(params) else ("cond",)

    def check_params(self, params: SamplingParams, inputs) -> None:
        super().check_params(params, inputs)
        if params.negative_prompt is not None and not uses_cfg(params):
            raise InvalidRequestError("negative_prompt", params.negative_prompt,
                                      "unset without classifier-free guidance (guidance_scale <= 1)")

    def pad_keys(self) -> dict[str, tuple[str | None, float]]:
        return {"ar_kv": ("ar_kv_mask", 0.0)}

    def prepare_request(self, state: RequestState) -> None:
        """The branches' K/V from the received payloads, latents drawn as the reference
        pipeline draws them, the request's own flow-matching scheduler."""
        p = state.params
        n = p.num_images_per_prompt
        pipe = self.pipe
        constant = pipe.constant_context(1, self.dtype)
        branches = []
        for name in self.context_branches(p):
            kv = state.context[name].tensors["kv"].to(self.device, self.dtype)
            branches.append({"ar_kv": repeat_rows(kv.unsqueeze(0), n),
                             "encoder_hidden_states": repeat_rows(constant["encoder_hidden_states"], n),
                             "pooled_projections": repeat_rows(constant["pooled_projections"], n)})
        state.branches = branches
        state.guidance_scale = p.guidance_scale
        shape = (n, pipe.transformer.config.in_channels, p.height // pipe.vae_scale_factor,
                 p.width // pipe.vae_scale_factor)
        state.latents = randn_tensor(shape, generator=state.generator, device=self.device, dtype=self.dtype)
        scheduler = new_scheduler(pipe.scheduler)
        timesteps, _ = retrieve_timesteps(scheduler, p.num_inference_steps, self.device)
        state.timesteps = timesteps
        state.sigmas = batchable_sigmas(scheduler, len(timesteps))
        state.scheduler = scheduler

    def denoise_kwargs(self, batch: StepBatch) -> dict[str, Any]:
        inputs = dict(batch.inputs)
        inputs["joint_attention_kwargs"] = {"ar_kv": inputs.pop("ar_kv"), "ar_kv_mask": inputs.pop("ar_kv_mask", None)}
        return inputs

    def decode(self, state: RequestState, latents: torch.Tensor | None = None) -> Any:
        latents = state.latents if latents is None else latents
        if state.params.output_type == "latent":
            return latents
        vae = self.pipe.vae
        image = vae.decode(latents / vae.config.scaling_factor + vae.config.shift_factor, return_dict=False)[0]
        return self.pipe.image_processor.postprocess(checked_pixels(image), output_type=state.params.output_type)


__all__ = ["DigitsReasoningAdapter"]
