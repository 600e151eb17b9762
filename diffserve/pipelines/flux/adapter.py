"""Adapter for FLUX.1 (`FluxPipeline` folders, schnell and dev layouts).

FLUX.1 (Black Forest Labs 2024): an MMDiT `FluxTransformer2DModel` (double-stream then
single-stream blocks, 2-D RoPE over ``(id, row, col)`` position ids), CLIP-L (pooled only) + T5
text encoders, a 16-channel `AutoencoderKL` and a `FlowMatchEulerDiscreteScheduler`. Latents are
packed: each 2x2 latent patch is one token, (N, h*w/4, 4C). Prompt encoding, latents, position
ids, timesteps and unpacking reuse diffusers' own `FluxPipeline` methods on the same components,
so an image equals diffusers' for the same seed (tests/pipelines/test_flux.py).

Guidance, as diffusers' ``FluxPipeline.__call__`` means it:

- ``guidance_scale``: the embedded guidance of guidance-distilled transformers
  (``guidance_embeds=True``, FLUX.1-dev): an input of the model, one value per row, so requests
  with different values share a forward. Folders without it (FLUX.1-schnell) refuse the field.
- ``true_cfg_scale`` + ``negative_prompt``: true CFG with a real negative branch. diffusers runs it
  when ``true_cfg_scale > 1 and negative_prompt is not None``, and `FluxAdapter.branches` follows
  that rule exactly: ``negative_prompt=""`` with ``true_cfg_scale > 1`` is true CFG against the
  empty prompt; a negative prompt with ``true_cfg_scale <= 1``, or ``true_cfg_scale > 1`` without a
  negative prompt, runs one branch (diffusers ignores them then, and so does diffserve).

Requests of different sizes share a forward (`mixed_sizes`, `diffserve.pipelines.token_spans`,
`flux/mixed_sizes.py`): each request's packed sequence is right-padded to the batch's longest,
and every row keeps its own RoPE positions and attention span; in eager forwards each block
runs once per row size on real tokens only (`length_groups`).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch
from diffusers import FluxPipeline
from diffusers.pipelines.flux.pipeline_flux import calculate_shift, retrieve_timesteps

from diffserve.pipelines.base import PipelineAdapter, RequestState, StepBatch, checked_pixels
from diffserve.pipelines.capabilities import CacheDiTSupport, Capabilities
from diffserve.pipelines.flux.mixed_sizes import install_token_spans, set_token_span, span_inputs
from diffserve.pipelines.flux.teacache import TEACACHE
from diffserve.pipelines.guidance import Guidance
from diffserve.pipelines.text_encoding import TextEncoder

# diffserve reports truncation itself (GenerationOutput.prompt_truncated).
logging.getLogger("diffusers.pipelines.flux.pipeline_flux").setLevel(logging.ERROR)


class FluxAdapter(PipelineAdapter):
    """Step-contract adapter over a diffusers `FluxPipeline`.

    Tensors: latents packed (N, (H/16)*(W/16), 4C) in the model dtype; per branch
    ``encoder_hidden_states`` (N, max_sequence_length, D_t5), ``pooled_projections`` (N, D_clip)
    and, with embedded guidance, ``guidance`` (N,) float32; shared by the batch ``img_ids``
    ((H/16)*(W/16), 3) and ``txt_ids`` (max_sequence_length, 3) (the batch key holds
    max_sequence_length). Rows of different sizes: latents right-padded to the longest
    sequence L_max, ``img_ids`` padded to it (each row's own positions come from its row data,
    `flux.mixed_sizes`). True-CFG branches: [negative, positive]. ``output_type="latent"``
    returns the packed latents, as diffusers does.
    """

    pipeline_class_name = "FluxPipeline"
    pipeline_class = FluxPipeline
    # diffusers' FluxPipeline.__call__ defaults
    sampling_defaults = {"num_inference_steps": 28, "guidance_scale": 3.5, "true_cfg_scale": 1.0,
                         "max_sequence_length": 512}
    #: the T5 length sets ``txt_ids``, shared by the batch
    batch_key_fields = ("max_sequence_length",)
    text_inputs = ("encoder_hidden_states", "pooled_projections")
    per_request_samplers = True
    mixed_sizes = True

    def setup(self) -> dict[str, Any]:
        """True CFG, plus embedded guidance on guidance-distilled transformers (FLUX.1-dev);
        CLIP + T5 encoding in batches; TeaCache and cache-dit."""
        pipe = self.pipe
        self.guidance = Guidance("true_cfg_scale", embedded=bool(pipe.transformer.config.guidance_embeds))
        self.text = TextEncoder(self, self._encode_text,
                                [(pipe.tokenizer, pipe.tokenizer_max_length), (pipe.tokenizer_2, None)], batched=True)
        # Both block kinds take (hidden_states, encoder_hidden_states) and return
        # (encoder_hidden_states, hidden_states): cache-dit's Pattern_1, as in its own Flux
        # adapter (cache-dit 1.5.3, CACHE_DIT_FLUX_ENABLE_DUMMY_BLOCKS=0 layout).
        self.capabilities = Capabilities(
            teacache=TEACACHE, cache_dit=CacheDiTSupport(blocks=("transformer_blocks", "single_transformer_blocks"),
                                                         patterns=("Pattern_1", "Pattern_1")))
        self.mixed_sizes = self.mixed_sizes and install_token_spans(pipe.transformer, grouped=self.grouping)
        # VAE down-sampling x 2x2 packing; diffusers' check_inputs refuses more than 512 T5 tokens
        return {"resolution_factor": pipe.vae_scale_factor * 2, "max_sequence_length_limit": 512,
                "max_prompt_tokens": pipe.tokenizer_max_length}

    def _encode_text(self, text: str | list[str], max_sequence_length: int | None):
        """diffusers' Flux encoding of a text (or of n texts, a row each: CLIP and T5 pad to
        fixed lengths, so a row equals the text alone): T5 prompt_embeds (n, L, D) and CLIP
        pooled (n, P)."""
        pe, pooled, _ = self.pipe.encode_prompt(prompt=text, prompt_2=None, device=self.device,
                                                num_images_per_prompt=1, max_sequence_length=max_sequence_length)
        return pe, pooled

    def encode_branches(self, state: RequestState) -> None:
        """Per-branch text inputs (and embedded guidance) and the shared ``txt_ids``."""
        state.branches = self.text_branches(state)
        text_dtype = self.pipe.text_encoder.dtype if self.pipe.text_encoder is not None else self.dtype
        state.shared = {"txt_ids": torch.zeros(state.params.max_sequence_length, 3, device=self.device,
                                               dtype=text_dtype)}

    def prepare_request(self, state: RequestState) -> None:
        """Encode the prompt(s) through the cache, draw packed latents and position ids exactly
        as diffusers does, and set the request's own scheduler and timesteps."""
        self.encode_branches(state)
        p, pipe = state.params, self.pipe
        state.latents, img_ids = pipe.prepare_latents(p.num_images_per_prompt, self.latent_channels, p.height, p.width,
                                                      self.embeds_dtype(state), self.device, state.generator)
        state.shared["img_ids"] = img_ids
        self.set_timesteps(state, image_seq_len=state.latents.shape[1])
        set_token_span(state, pipe.vae_scale_factor, self.mixed_sizes)

    @staticmethod
    def embeds_dtype(state: RequestState) -> torch.dtype:
        """The prompt embeddings' dtype (diffusers draws the latents in it)."""
        return state.branches[-1]["encoder_hidden_states"].dtype

    @property
    def latent_channels(self) -> int:
        """VAE latent channels (the transformer's input channels / 2x2 packing)."""
        return self.pipe.transformer.config.in_channels // 4

    #: diffusers' ``FluxPipeline.__call__`` lets a scheduler with ``use_flow_sigmas`` make its
    #: own sigmas; ``FluxKontextPipeline``'s always passes the linear ones.
    flow_sigmas_from_scheduler: bool = True

    def _linear_sigmas(self, scheduler: Any, num_steps: int) -> np.ndarray | None:
        """The linear sigmas ``linspace(1, 1/N, N)`` diffusers passes, or None where it lets the
        scheduler make flow sigmas."""
        if self.flow_sigmas_from_scheduler and scheduler.config.get("use_flow_sigmas"):
            return None
        return np.linspace(1.0, 1 / num_steps, num_steps)

    def timestep_arguments(self, scheduler: Any, num_steps: int) -> dict[str, Any]:
        """``mu`` (always) and the linear ``sigmas`` where diffusers passes them."""
        sigmas = self._linear_sigmas(scheduler, num_steps)
        return {"mu": 1.0, **({} if sigmas is None else {"sigmas": sigmas})}

    def set_timesteps(self, state: RequestState, image_seq_len: int) -> None:
        """diffusers' Flux schedule on the request's own scheduler (`request_scheduler`): sigmas
        ``linspace(1, 1/N, N)`` (or the scheduler's flow sigmas, `_linear_sigmas`) shifted by
        ``mu`` = `calculate_shift` of the packed token count (dynamic shifting), or by the
        config's ``shift``; timesteps = sigmas x 1000."""
        n = state.params.num_inference_steps
        scheduler = self.request_scheduler(state.params)
        config = scheduler.config
        sigmas = self._linear_sigmas(scheduler, n)
        mu = calculate_shift(image_seq_len, config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
                             config.get("base_shift", 0.5), config.get("max_shift", 1.15))
        timesteps, _ = retrieve_timesteps(scheduler, n, self.device, sigmas=sigmas, mu=mu)
        scheduler.set_begin_index(0)
        self.set_schedule(state, scheduler, timesteps)

    def forward_inputs(self, batch: StepBatch) -> dict[str, Any]:
        """The batch inputs with ``timestep / 1000`` in the latents' dtype (the transformer
        multiplies it back, as in diffusers); rows of different sizes with their token spans
        (`flux.mixed_sizes.span_inputs`)."""
        return span_inputs(batch, {**batch.inputs, "timestep": batch.inputs["timestep"].to(batch.latents.dtype) / 1000})

    def decode(self, state: RequestState, latents: torch.Tensor | None = None) -> Any:
        """Unpack to (N, C, H/8, W/8), unscale (latents / scaling_factor + shift_factor),
        VAE-decode and post-process to the request's output_type."""
        latents = state.latents if latents is None else latents
        p = state.params
        if p.output_type == "latent":
            return latents
        pipe, vae = self.pipe, self.pipe.vae
        # a mixed batch's rows are views of its padded latents: unpacking needs them contiguous
        latents = pipe._unpack_latents(latents.contiguous(), p.height, p.width, pipe.vae_scale_factor)
        latents = latents / vae.config.scaling_factor + vae.config.shift_factor
        image = vae.decode(latents.to(vae.dtype), return_dict=False)[0]
        return pipe.image_processor.postprocess(checked_pixels(image), output_type=p.output_type)
