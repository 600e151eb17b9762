"""Step adapter of `digits-reasoning` (`DigitsReasoningPipeline` folders): the DiT stage.

The AR stage (`ar_stage.DigitsReasoningARStage`) hands each request's K/V through the
connector; the runner puts the received payloads in ``RequestState.context`` before `prepare`.
Per guidance branch (``"negative"`` then ``"cond"`` with CFG), the branch input ``ar_kv`` is the
LM's K/V (rows, L, layers, 2, H, D). Requests whose contexts differ in length share forwards:
``ar_kv`` is right-padded to the batch's longest and ``ar_kv_mask`` (rows, L) marks the real
tokens (`padded_inputs`), so each row equals its solo forward. Prompt encoding, latents, timesteps,
CFG and decode are the reference `DigitsReasoningPipeline.__call__`'s.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import retrieve_timesteps
from diffusers.utils.torch_utils import randn_tensor

from diffserve.core.errors import InvalidRequestError
from diffserve.core.sampling_params import SamplingParams
from diffserve.pipelines.base import PipelineAdapter, RequestState, StepBatch, checked_pixels
from diffserve.pipelines.diffusion_scheduler import new_scheduler
from diffserve.pipelines.digits_reasoning.ar_stage import DigitsReasoningARStage, uses_cfg
from diffserve.pipelines.digits_reasoning.pipeline import DigitsReasoningPipeline
from diffserve.pipelines.text_encoding import repeat_rows


class DigitsReasoningAdapter(PipelineAdapter):
    """The DiT stage of `digits-reasoning` (see the module docstring).

    Tensors: latents (N, 1, 8, 8); per branch ``ar_kv`` (N, L, layers, 2, H, D),
    ``encoder_hidden_states`` (N, 1, J) and ``pooled_projections`` (N, P) zeros, model dtype.
    """

    pipeline_class_name = "DigitsReasoningPipeline"
    pipeline_class = DigitsReasoningPipeline
    ar_stage_components = ("language_model", "tokenizer")
    optional_components = ar_stage_components  # built without them: the AR stage has its own runner
    # DigitsReasoningPipeline.__call__ defaults
    sampling_defaults = {"num_inference_steps": 20, "guidance_scale": 4.0}
    #: the LM's K/V of different lengths: right-padded, the mask marks the real tokens
    padded_inputs = {"ar_kv": ("ar_kv_mask", 0.0)}

    def setup(self) -> dict[str, Any]:
        """No text encoder (the DiT reads the LM's K/V); the positional grid bounds the size."""
        pipe, transformer = self.pipe, self.pipe.transformer.config
        max_side = transformer.pos_embed_max_size * transformer.patch_size * pipe.vae_scale_factor
        return {"resolution_factor": pipe.vae_scale_factor * transformer.patch_size, "max_height": max_side,
                "max_width": max_side}

    def default_size(self) -> tuple[int, int]:
        """The transformer's ``sample_size`` x the VAE scale factor (8x8 pixels)."""
        side = self.pipe.transformer.config.sample_size * self.pipe.vae_scale_factor
        return side, side

    @classmethod
    def build_ar_stage(cls, components: dict[str, Any], device: torch.device, dtype: torch.dtype):
        """The AR stage model from the ``language_model`` and ``tokenizer`` components."""
        lm = components["language_model"].to(device)
        return DigitsReasoningARStage(lm, components["tokenizer"])

    def context_branches(self, params: SamplingParams) -> tuple[str, ...]:
        """The payload branches a request needs: ``("negative", "cond")`` with CFG, else ``("cond",)``."""
        return ("negative", "cond") if uses_cfg(params) else ("cond",)

    def check_params(self, params: SamplingParams, inputs) -> None:
        super().check_params(params, inputs)
        if params.negative_prompt is not None and not uses_cfg(params):
            raise InvalidRequestError("negative_prompt", params.negative_prompt,
                                      "unset without classifier-free guidance (guidance_scale <= 1)")

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
        shape = (n, pipe.transformer.config.in_channels, p.height // pipe.vae_scale_factor,
                 p.width // pipe.vae_scale_factor)
        state.latents = randn_tensor(shape, generator=state.generator, device=self.device, dtype=self.dtype)
        scheduler = new_scheduler(pipe.scheduler)
        timesteps, _ = retrieve_timesteps(scheduler, p.num_inference_steps, self.device)
        self.set_schedule(state, scheduler, timesteps)

    def forward_inputs(self, batch: StepBatch) -> dict[str, Any]:
        """The K/V and their mask go to the attention processors as ``joint_attention_kwargs``."""
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
