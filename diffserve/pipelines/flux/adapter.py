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
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch
from diffusers import FluxPipeline
from diffusers.pipelines.flux.pipeline_flux import calculate_shift, retrieve_timesteps

from diffserve.pipelines import teacache_coefficients
from diffserve.pipelines.base import (
    AdapterOptions,
    Capabilities,
    CacheDiTSupport,
    PipelineAdapter,
    RequestState,
    StepBatch,
    TeaCacheSupport,
    checked_pixels,
)
from diffserve.pipelines.diffusion_scheduler import batchable_sigmas, new_scheduler
from diffserve.pipelines.generation_config import read_generation_config
from diffserve.pipelines.text_encoding import TextEncoder, repeat_rows
from diffserve.core.sampling_params import ModelSpec, SamplingParams

# diffserve reports truncation itself (GenerationOutput.prompt_truncated).
logging.getLogger("diffusers.pipelines.flux.pipeline_flux").setLevel(logging.ERROR)

# diffusers' FluxPipeline.__call__ defaults.
DEFAULT_NUM_INFERENCE_STEPS = 28
DEFAULT_GUIDANCE_SCALE = 3.5
DEFAULT_TRUE_CFG_SCALE = 1.0
DEFAULT_MAX_SEQUENCE_LENGTH = 512
#: diffusers' check_inputs refuses more T5 tokens than this.
MAX_SEQUENCE_LENGTH_LIMIT = 512


class FluxTeaCacheSplit:
    """`FluxTransformer2DModel.forward` (diffusers 0.42) in three parts around the blocks, for
    TeaCache; the modulated input is the first double block's ``norm1`` output, as in
    TeaCache4FLUX. Covers the text-to-image / Kontext path (no ControlNet, IP-Adapter).

    Tensors: hidden (rows, N_img, D) (reference-image tokens included for Kontext); context =
    dict(encoder (rows, N_txt, D), temb (rows, D), rotary (cos, sin) of (N_txt + N_img, head_dim),
    joint_attention_kwargs); output (rows, N_img, 4C).
    """

    @staticmethod
    def embed(model, kwargs: dict[str, Any]):
        """Returns (hidden, context, modulated input of the first double block)."""
        hidden = model.x_embedder(kwargs["hidden_states"])
        timestep = kwargs["timestep"].to(hidden.dtype) * 1000
        guidance = kwargs.get("guidance")
        if guidance is None:
            temb = model.time_text_embed(timestep, kwargs["pooled_projections"])
        else:
            temb = model.time_text_embed(timestep, guidance.to(hidden.dtype) * 1000, kwargs["pooled_projections"])
        encoder = model.context_embedder(kwargs["encoder_hidden_states"])
        rotary = model.pos_embed(torch.cat((kwargs["txt_ids"], kwargs["img_ids"]), dim=0))
        modulated = model.transformer_blocks[0].norm1(hidden, emb=temb)[0]
        context = {"encoder": encoder, "temb": temb, "rotary": rotary,
                   "joint_attention_kwargs": kwargs.get("joint_attention_kwargs")}
        return hidden, context, modulated

    @staticmethod
    def select_rows(context: dict[str, Any], index: torch.Tensor) -> dict[str, Any]:
        return {**context, "encoder": context["encoder"][index], "temb": context["temb"][index]}

    @staticmethod
    def blocks(model, hidden: torch.Tensor, context: dict[str, Any]) -> torch.Tensor:
        """Every double then single block; returns the image stream (rows, N_img, D)."""
        encoder = context["encoder"]
        for block in (*model.transformer_blocks, *model.single_transformer_blocks):
            encoder, hidden = block(hidden_states=hidden, encoder_hidden_states=encoder, temb=context["temb"],
                                    image_rotary_emb=context["rotary"],
                                    joint_attention_kwargs=context["joint_attention_kwargs"])
        return hidden

    @staticmethod
    def head(model, hidden: torch.Tensor, context: dict[str, Any]) -> torch.Tensor:
        """norm_out and proj_out: (rows, N_img, 4C)."""
        return model.proj_out(model.norm_out(hidden, context["temb"]))


class FluxAdapter(PipelineAdapter):
    """Step-contract adapter over a diffusers `FluxPipeline`.

    Tensors: latents packed (N, (H/16)*(W/16), 4C) in the model dtype; per branch
    ``encoder_hidden_states`` (N, max_sequence_length, D_t5), ``pooled_projections`` (N, D_clip)
    and, with embedded guidance, ``guidance`` (N,) float32; shared by the batch ``img_ids``
    ((H/16)*(W/16), 3) and ``txt_ids`` (max_sequence_length, 3) (equal within a batch key: the
    key holds the size and max_sequence_length). True-CFG branches: [negative, positive].
    ``output_type="latent"`` returns the packed latents, as diffusers does.
    """

    pipeline_class_name = "FluxPipeline"
    pipeline_class: type = FluxPipeline
    #: whether requests carry input images (`FluxKontextAdapter`)
    accepts_images = False

    def __init__(self, pipe: FluxPipeline, device: torch.device, dtype: torch.dtype, options: AdapterOptions):
        self.pipe = pipe
        self.device = device
        self.dtype = dtype
        self.guidance_embeds = bool(pipe.transformer.config.guidance_embeds)
        config = read_generation_config(options.model_dir)
        default_side = pipe.default_sample_size * pipe.vae_scale_factor
        self.spec = ModelSpec(
            pipeline=self.pipeline_class_name,
            resolution_factor=pipe.vae_scale_factor * 2,  # VAE down-sampling x 2x2 packing
            default_height=int(config.get("height", default_side)),
            default_width=int(config.get("width", default_side)),
            default_num_inference_steps=int(config.get("num_inference_steps", DEFAULT_NUM_INFERENCE_STEPS)),
            # a transformer without guidance embedding (schnell) has no use for guidance_scale
            default_guidance_scale=(float(config.get("guidance_scale", DEFAULT_GUIDANCE_SCALE))
                                    if self.guidance_embeds else None),
            default_true_cfg_scale=float(config.get("true_cfg_scale", DEFAULT_TRUE_CFG_SCALE)),
            default_max_sequence_length=int(config.get("max_sequence_length", DEFAULT_MAX_SEQUENCE_LENGTH)),
            max_sequence_length_limit=MAX_SEQUENCE_LENGTH_LIMIT,
            text_conditioned=True,
            max_prompt_tokens=pipe.tokenizer_max_length,
            accepts_images=self.accepts_images,
        )
        teacache = config.get("teacache", {})
        self.capabilities = Capabilities(
            teacache=TeaCacheSupport(
                split=FluxTeaCacheSplit,
                coefficients=tuple(teacache.get("coefficients", teacache_coefficients.FLUX_DEV)),
                rel_l1_thresh=float(teacache.get("rel_l1_thresh", 0.4)),
                source=teacache.get("source", teacache_coefficients.FLUX_DEV_SOURCE),
            ),
            # Both block kinds take (hidden_states, encoder_hidden_states) and return
            # (encoder_hidden_states, hidden_states): cache-dit's Pattern_1, as in its own Flux
            # adapter (cache-dit 1.5.3, CACHE_DIT_FLUX_ENABLE_DUMMY_BLOCKS=0 layout).
            cache_dit=CacheDiTSupport(blocks=("transformer_blocks", "single_transformer_blocks"),
                                      patterns=("Pattern_1", "Pattern_1")),
            repeated_blocks=tuple(getattr(pipe.transformer, "_repeated_blocks", None) or ()),
        )
        self.text = TextEncoder(self, self._encode_text,
                                [(pipe.tokenizer, pipe.tokenizer_max_length), (pipe.tokenizer_2, None)], batched=True)

    @classmethod
    def from_components(cls, components, device, dtype, options):
        components = {**components}
        for optional in ("image_encoder", "feature_extractor"):
            components.setdefault(optional, None)
        pipe = cls.pipeline_class(**components)
        pipe.to(device, silence_dtype_warnings=True)
        pipe.set_progress_bar_config(disable=True)
        return cls(pipe, device, dtype, options)

    @property
    def denoiser(self) -> torch.nn.Module:
        return self.pipe.transformer

    def branches(self, params: SamplingParams) -> int:
        """2 with true CFG (diffusers' rule: ``true_cfg_scale > 1 and negative_prompt is not
        None``), else 1; embedded guidance never adds rows."""
        return 2 if params.true_cfg_scale is not None and params.true_cfg_scale > 1.0 \
            and params.negative_prompt is not None else 1

    def extra_batch_key(self, params: SamplingParams):
        """The T5 length: it sets ``txt_ids``, shared by the batch."""
        return params.max_sequence_length

    def _encode_text(self, text: str | list[str], max_sequence_length: int | None):
        """diffusers' Flux encoding of a text (or of n texts, a row each: CLIP and T5 pad to
        fixed lengths, so a row equals the text alone): T5 prompt_embeds (n, L, D) and CLIP
        pooled (n, P)."""
        pe, pooled, _ = self.pipe.encode_prompt(prompt=text, prompt_2=None, device=self.device,
                                                num_images_per_prompt=1, max_sequence_length=max_sequence_length)
        return pe, pooled

    def encode_branches(self, state: RequestState) -> None:
        """Per-branch text inputs (and embedded guidance), `state.guidance_scale` (the true-CFG
        weight) and the shared ``txt_ids``."""
        p = state.params
        n, L = p.num_images_per_prompt, p.max_sequence_length
        texts = [p.negative_prompt, state.prompt] if self.branches(p) == 2 else [state.prompt]
        branches = []
        for text in texts:
            pe, pooled = self.text.encode(text, L)
            branch = {"encoder_hidden_states": repeat_rows(pe, n), "pooled_projections": repeat_rows(pooled, n)}
            if self.guidance_embeds:
                branch["guidance"] = torch.full((n,), p.guidance_scale, device=self.device, dtype=torch.float32)
            branches.append(branch)
        state.branches = branches
        state.guidance_scale = p.true_cfg_scale if len(branches) == 2 else 1.0
        text_dtype = self.pipe.text_encoder.dtype if self.pipe.text_encoder is not None else self.dtype
        state.shared = {"txt_ids": torch.zeros(L, 3, device=self.device, dtype=text_dtype)}

    def prepare_request(self, state: RequestState) -> None:
        """Encode the prompt(s) through the cache, draw packed latents and position ids exactly
        as diffusers does, and set the request's own scheduler and timesteps."""
        self.encode_branches(state)
        p, pipe = state.params, self.pipe
        state.latents, img_ids = pipe.prepare_latents(p.num_images_per_prompt, self.latent_channels, p.height, p.width,
                                                      self.embeds_dtype(state), self.device, state.generator)
        state.shared["img_ids"] = img_ids
        self.set_timesteps(state, image_seq_len=state.latents.shape[1])

    @staticmethod
    def embeds_dtype(state: RequestState) -> torch.dtype:
        """The prompt embeddings' dtype (diffusers draws the latents in it)."""
        return state.branches[-1]["encoder_hidden_states"].dtype

    @property
    def latent_channels(self) -> int:
        """VAE latent channels (the transformer's input channels / 2x2 packing)."""
        return self.pipe.transformer.config.in_channels // 4

    def set_timesteps(self, state: RequestState, image_seq_len: int) -> None:
        """diffusers' Flux schedule: sigmas ``linspace(1, 1/N, N)`` shifted by ``mu`` =
        `calculate_shift` of the packed token count (dynamic shifting), or by the config's
        ``shift``; timesteps = sigmas x 1000."""
        n = state.params.num_inference_steps
        scheduler = new_scheduler(self.pipe.scheduler)
        config = scheduler.config
        sigmas = None if config.get("use_flow_sigmas") else np.linspace(1.0, 1 / n, n)
        mu = calculate_shift(image_seq_len, config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
                             config.get("base_shift", 0.5), config.get("max_shift", 1.15))
        timesteps, _ = retrieve_timesteps(scheduler, n, self.device, sigmas=sigmas, mu=mu)
        scheduler.set_begin_index(0)
        state.scheduler = scheduler
        state.timesteps = timesteps
        state.sigmas = batchable_sigmas(scheduler, len(timesteps))

    def denoise_kwargs(self, batch: StepBatch) -> dict[str, Any]:
        """The batch inputs with ``timestep / 1000`` in the latents' dtype (the transformer
        multiplies it back, as in diffusers)."""
        return {**batch.inputs, "timestep": batch.inputs["timestep"].to(batch.latents.dtype) / 1000}

    def decode(self, state: RequestState, latents: torch.Tensor | None = None) -> Any:
        """Unpack to (N, C, H/8, W/8), unscale (latents / scaling_factor + shift_factor),
        VAE-decode and post-process to the request's output_type."""
        latents = state.latents if latents is None else latents
        p = state.params
        if p.output_type == "latent":
            return latents
        pipe, vae = self.pipe, self.pipe.vae
        latents = pipe._unpack_latents(latents, p.height, p.width, pipe.vae_scale_factor)
        latents = latents / vae.config.scaling_factor + vae.config.shift_factor
        image = vae.decode(latents.to(vae.dtype), return_dict=False)[0]
        return pipe.image_processor.postprocess(checked_pixels(image), output_type=p.output_type)
