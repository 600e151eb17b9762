"""Adapter for Wan text-to-video (`WanPipeline` folders: Wan 2.1 T2V, Wan 2.2 T2V / TI2V).

Wan (Wan team 2025, "Wan: Open and Advanced Large-Scale Video Generative Models",
arXiv:2503.20314): a UMT5 text encoder, a `WanTransformer3DModel` DiT with 3-D RoPE over
(frames, height, width) patches, the causal 3-D VAE `AutoencoderKLWan` (8x spatial, 4x
temporal down-sampling: F = 4k + 1 frames -> k + 1 latent frames) and a flow-matching
scheduler (the folders ship `UniPCMultistepScheduler` with flow sigmas and ``flow_shift``).
Wan 2.2 A14B (``boundary_ratio`` in ``model_index.json``) has two experts: ``transformer``
denoises the steps with timestep >= ``boundary_ratio * num_train_timesteps`` (high noise) with
``guidance_scale``, ``transformer_2`` the rest with ``guidance_scale_2``; requests on different
experts never share a forward (`step_key`). Prompt encoding, latents, timesteps and video
post-processing reuse diffusers' `WanPipeline` methods on the same components, so a video
equals diffusers' for the same seed (tests/pipelines/test_wan.py).

With context folding (``EngineConfig.context_folding``, on by default) the zero padding rows of
the prompts run as one row with an attention bias (:mod:`diffserve.pipelines.wan.context_folding`,
an exact identity): the cross-attention sees the batch's longest prompt plus one row instead of
``max_sequence_length`` rows.

Streams (``num_chunks``): each chunk after the first has its first latent frame fixed to the
previous chunk's last frame, re-encoded by the causal VAE: clean with timestep-0 tokens on
folders with ``expand_timesteps`` (Wan 2.2 TI2V's first-frame conditioning), else by the
replacement method (see `diffserve.pipelines.video_chunks`); interactions swap the conditional
branch's UMT5 states.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch
from diffusers import WanPipeline
from diffusers.pipelines.wan.pipeline_wan import prompt_clean

from diffserve.core.errors import UnsupportedModelError
from diffserve.pipelines import guidance
from diffserve.pipelines.wan import context_folding as wan_context_folding
from diffserve.pipelines.base import (
    AdapterOptions,
    Capabilities,
    CacheDiTSupport,
    DenoiserCall,
    PipelineAdapter,
    RequestState,
    StepBatch,
    TeaCacheSupport,
    checked_pixels,
)
from diffserve.pipelines.diffusion_scheduler import batchable_sigmas, new_scheduler
from diffserve.pipelines.generation_config import read_generation_config
from diffserve.pipelines.text_encoding import TextEncoder, repeat_rows
from diffserve.pipelines.video_chunks import ChunkCondition, frames_to_video_tensor, per_token_timesteps
from diffserve.core.sampling_params import ModelSpec, SamplingParams

logging.getLogger("diffusers.pipelines.wan.pipeline_wan").setLevel(logging.ERROR)

# diffusers' WanPipeline.__call__ defaults (480x832, 81 frames, 50 steps, CFG 5, 512 tokens)
# and Wan 2.1's 16 frames per second (the Wan repository's sample_fps).
DEFAULT_HEIGHT, DEFAULT_WIDTH, DEFAULT_NUM_FRAMES = 480, 832, 81
DEFAULT_NUM_INFERENCE_STEPS = 50
DEFAULT_GUIDANCE_SCALE = 5.0
DEFAULT_MAX_SEQUENCE_LENGTH = 512
DEFAULT_FPS = 16
#: Wan's UMT5 context length (``text_len`` in the Wan repository).
MAX_SEQUENCE_LENGTH_LIMIT = 512
#: Wan 2.2 two-expert folders: ``RequestState.extra`` key of the number of leading steps the
#: high-noise expert runs (those with timestep >= the boundary).
HIGH_NOISE_STEPS = "wan_high_noise_steps"

#: TeaCache4Wan2.1 (github.com/ali-vilab/TeaCache, TeaCache4Wan2.1/teacache_generate.py, T2V,
#: modulated input = the time embedding ``e``, first and last step computed): rescaling
#: coefficients and the threshold of its README's ~2x row, by transformer width.
WAN21_TEACACHE = {
    1536: ((2.39676752e03, -1.31110545e03, 2.01331979e02, -8.29855975e00, 1.37887774e-01), 0.08, "1.3B"),
    5120: ((-5784.54975374, 5449.50911966, -1811.16591783, 256.27178429, -13.02252404), 0.2, "14B"),
}


class WanTeaCacheSplit:
    """`WanTransformer3DModel.forward` (diffusers 0.42) in three parts around the blocks, for
    TeaCache; text-to-video with one timestep per row (no image embeddings, no per-token
    timesteps).

    Tensors: hidden (rows, N_patches, D); context = dict(encoder (rows, L, D), temb (rows, D),
    proj (rows, 6, D), rotary (cos, sin), each (1, N_patches, 1, head_dim), shape of the
    latent input (rows, C, F, h, w)); modulated = temb (TeaCache4Wan2.1's ``e``); output
    (rows, C_out, F, h, w).
    """

    @staticmethod
    def embed(model, kwargs: dict[str, Any]):
        x = kwargs["hidden_states"]
        rotary = model.rope(x)
        hidden = model.patch_embedding(x).flatten(2).transpose(1, 2).contiguous()
        temb, proj, encoder, _ = model.condition_embedder(kwargs["timestep"], kwargs["encoder_hidden_states"])
        context = {"encoder": encoder, "temb": temb, "proj": proj.unflatten(1, (6, -1)), "rotary": rotary,
                   "shape": tuple(x.shape)}
        return hidden, context, temb

    @staticmethod
    def select_rows(context: dict[str, Any], index: torch.Tensor) -> dict[str, Any]:
        return {**context, "encoder": context["encoder"][index], "temb": context["temb"][index],
                "proj": context["proj"][index]}

    @staticmethod
    def blocks(model, hidden: torch.Tensor, context: dict[str, Any]) -> torch.Tensor:
        for block in model.blocks:
            hidden = block(hidden, context["encoder"], context["proj"], context["rotary"])
        return hidden

    @staticmethod
    def head(model, hidden: torch.Tensor, context: dict[str, Any]) -> torch.Tensor:
        """Output norm, projection and unpatchify to (rows, C_out, F, h, w)."""
        temb = context["temb"]
        shift, scale = (model.scale_shift_table.to(temb.device) + temb.unsqueeze(1)).chunk(2, dim=1)
        hidden = (model.norm_out(hidden.float()) * (1 + scale) + shift).type_as(hidden)
        hidden = model.proj_out(hidden)
        _, _, f, h, w = context["shape"]
        p_t, p_h, p_w = model.config.patch_size
        hidden = hidden.reshape(hidden.shape[0], f // p_t, h // p_h, w // p_w, p_t, p_h, p_w, -1)
        return hidden.permute(0, 7, 1, 4, 2, 5, 3, 6).flatten(6, 7).flatten(4, 5).flatten(2, 3)


class WanAdapter(PipelineAdapter):
    """Step-contract adapter over a diffusers `WanPipeline`.

    Tensors: latents (N, C, F_lat, H/8, W/8) float32 as diffusers keeps them (cast to the
    transformer dtype per forward); per branch encoder_hidden_states (N, max_sequence_length,
    text_dim) zero-padded UMT5 states in the model dtype, or with context folding (N, K, text_dim):
    the rows up to the prompt's last token plus one zero row standing for the rest (a batch is
    right-padded with zero rows to its longest K). CFG branches: [negative, positive], one
    forward for both (diffusers runs two). Timestep: the scheduler's raw timestep (0..1000) per
    row, or per patch token with ``expand_timesteps`` (Wan 2.2 TI2V).
    """

    pipeline_class_name = "WanPipeline"
    chunk_streaming = True
    chunk_overlap_frames = 1

    def __init__(self, pipe: WanPipeline, device: torch.device, dtype: torch.dtype, options: AdapterOptions):
        self.pipe = pipe
        self.device = device
        self.dtype = dtype
        config = read_generation_config(options.model_dir)
        transformer = pipe.transformer
        self.experts = [transformer] if pipe.transformer_2 is None else [transformer, pipe.transformer_2]
        ratio = pipe.config.boundary_ratio
        if len(self.experts) == 2 and ratio is None:
            raise UnsupportedModelError(f"{options.model_dir}: a WanPipeline with transformer_2 needs "
                                        "boundary_ratio in model_index.json")
        self._denoiser = transformer if len(self.experts) == 1 else torch.nn.ModuleList(self.experts)
        #: timestep at and above which the high-noise expert runs (None: one expert)
        self.boundary = None if ratio is None else ratio * pipe.scheduler.config.num_train_timesteps
        self.expand_timesteps = bool(pipe.config.expand_timesteps)
        p_t, p_h, _ = transformer.config.patch_size
        spatial, temporal = pipe.vae_scale_factor_spatial, pipe.vae_scale_factor_temporal
        rope = transformer.config.rope_max_seq_len  # RoPE positions per axis, in patches
        guidance_scale = float(config.get("guidance_scale", DEFAULT_GUIDANCE_SCALE))
        self.spec = ModelSpec(
            pipeline=self.pipeline_class_name,
            resolution_factor=spatial * p_h,
            default_height=int(config.get("height", DEFAULT_HEIGHT)),
            default_width=int(config.get("width", DEFAULT_WIDTH)),
            default_num_inference_steps=int(config.get("num_inference_steps", DEFAULT_NUM_INFERENCE_STEPS)),
            default_guidance_scale=guidance_scale,
            default_guidance_scale_2=(float(config.get("guidance_scale_2", guidance_scale))
                                      if self.boundary is not None else None),
            default_max_sequence_length=int(config.get("max_sequence_length", DEFAULT_MAX_SEQUENCE_LENGTH)),
            max_sequence_length_limit=MAX_SEQUENCE_LENGTH_LIMIT,
            text_conditioned=True,
            max_height=rope * p_h * spatial,
            max_width=rope * p_h * spatial,
            default_num_frames=int(config.get("num_frames", DEFAULT_NUM_FRAMES)),
            frame_factor=temporal,
            max_num_frames=(rope * p_t - 1) * temporal + 1,
            default_fps=int(config.get("fps", DEFAULT_FPS)),
        )
        self.capabilities = self._capabilities(config.get("teacache", {}))
        #: whether the zero padding rows of the prompts run as one row (text-to-video experts)
        self.context_folding = options.context_folding and all(
            wan_context_folding.supports_folding(e) for e in self.experts)
        if self.context_folding:
            for expert in self.experts:
                wan_context_folding.install_folded_cross_attention(expert)
        self.text = TextEncoder(self, self._encode_text, [(pipe.tokenizer, None)],
                                key=("folded" if self.context_folding else "full",))

    def _capabilities(self, teacache: dict[str, Any]) -> Capabilities:
        """TeaCache and cache-dit for one expert with one timestep per row (Wan 2.1 layout:
        the TeaCache4Wan2.1 coefficients, cache-dit's own Wan pattern); compile everywhere."""
        transformer = self.experts[0]
        if len(self.experts) > 1 or self.expand_timesteps or transformer.config.image_dim is not None:
            return Capabilities(repeated_blocks=("WanTransformerBlock",))
        width = transformer.config.num_attention_heads * transformer.config.attention_head_dim
        coefficients, thresh, size = WAN21_TEACACHE.get(width, WAN21_TEACACHE[1536])
        source = (f"TeaCache4Wan2.1 T2V-{size} coefficients (github.com/ali-vilab/TeaCache)"
                  + ("" if width in WAN21_TEACACHE else f"; no calibration for width {width}, the 1.3B one"))
        return Capabilities(
            teacache=TeaCacheSupport(
                split=WanTeaCacheSplit,
                coefficients=tuple(teacache.get("coefficients", coefficients)),
                rel_l1_thresh=float(teacache.get("rel_l1_thresh", thresh)),
                source=teacache.get("source", source)),
            # WanTransformerBlock(hidden_states, encoder_hidden_states, ...) -> hidden_states:
            # cache-dit's Pattern_2, as its own Wan adapter declares
            cache_dit=CacheDiTSupport(blocks=("blocks",), patterns=("Pattern_2",), has_encoder_residual=False),
            repeated_blocks=("WanTransformerBlock",),
        )

    @classmethod
    def from_components(cls, components, device, dtype, options):
        components = {**components}
        components.setdefault("transformer_2", None)
        from diffserve.models.model_index import pipeline_config

        index = pipeline_config(options.model_dir)
        pipe = WanPipeline(**components, boundary_ratio=index.get("boundary_ratio"),
                           expand_timesteps=bool(index.get("expand_timesteps", False)))
        pipe.to(device, silence_dtype_warnings=True)
        pipe.set_progress_bar_config(disable=True)
        return cls(pipe, device, dtype, options)

    @property
    def denoiser(self) -> torch.nn.Module:
        """The transformer; with two experts both (``nn.ModuleList`` [high-noise, low-noise]:
        what regional compile wraps; the per-step choice is `call_denoiser`'s)."""
        return self._denoiser

    # --------------------------------------------------------------- per request
    def extra_batch_key(self, params: SamplingParams):
        """The UMT5 length: prompts are zero-padded to it and attended without a mask (with
        context folding it sets the folded row's count)."""
        return params.max_sequence_length

    def pad_keys(self) -> dict[str, tuple[str | None, float]]:
        """With context folding, prompts of different lengths are right-padded with zero rows
        (exact: the padding is zero rows either way; no mask)."""
        return {"encoder_hidden_states": (None, 0.0)} if self.context_folding else {}

    def prompt_is_truncated(self, prompt: str, max_sequence_length: int | None = None) -> bool:
        return super().prompt_is_truncated(prompt_clean(prompt), max_sequence_length)

    def _encode_text(self, text: str, max_sequence_length: int | None):
        """diffusers' Wan encoding of one text: (1, max_sequence_length, text_dim), the UMT5
        states of its tokens then zeros, in the transformer dtype; with context folding cut to
        (1, K, text_dim) after its first padding row (`wan_context_folding.fold_padding_rows`)."""
        pe, _ = self.pipe.encode_prompt(prompt=text, do_classifier_free_guidance=False, num_videos_per_prompt=1,
                                        max_sequence_length=max_sequence_length, device=self.device)
        pe = pe.to(self.experts[0].dtype)
        return (wan_context_folding.fold_padding_rows(pe) if self.context_folding else pe,)

    def prepare_request(self, state: RequestState) -> None:
        """Encode prompt (and negative prompt under CFG) through the cache, draw float32 latents
        (N, C, F_lat, h, w) exactly as diffusers does, and create the request's own scheduler."""
        p = state.params
        texts = [p.negative_prompt or ""] if self.branches(p) == 2 else []
        state.branches = [self._text_branch(text, p) for text in texts] + [self.prompt_branch(state, state.prompt)]
        state.guidance_scale = p.guidance_scale
        state.latents = self._noise(state)
        self._new_schedule(state)

    def _text_branch(self, text: str, p: SamplingParams) -> dict[str, Any]:
        return {"encoder_hidden_states": repeat_rows(self.text.encode(text, p.max_sequence_length)[0],
                                                     p.num_images_per_prompt)}

    def prompt_branch(self, state: RequestState, prompt: str) -> dict[str, Any]:
        """``{"encoder_hidden_states": (N, max_sequence_length, text_dim)}`` for `prompt`."""
        return self._text_branch(prompt, state.params)

    def _noise(self, state: RequestState) -> torch.Tensor:
        """Initial latents (N, C, F_lat, h, w) float32 from the request's generator, as diffusers
        draws them."""
        p = state.params
        return self.pipe.prepare_latents(p.num_images_per_prompt, self.experts[0].config.in_channels, p.height,
                                         p.width, p.num_frames, torch.float32, self.device, state.generator)

    def _new_schedule(self, state: RequestState) -> None:
        """A fresh diffusion scheduler with the request's timesteps; step 0."""
        scheduler = new_scheduler(self.pipe.scheduler)
        scheduler.set_timesteps(state.params.num_inference_steps, device=self.device)
        scheduler.set_begin_index(0)
        state.scheduler = scheduler
        state.timesteps = scheduler.timesteps
        state.sigmas = batchable_sigmas(scheduler, len(state.timesteps))
        state.step_index = 0
        if self.boundary is not None:  # the timesteps decrease: the first k steps are the high-noise expert's
            state.extra[HIGH_NOISE_STEPS] = int((scheduler.timesteps.double() >= self.boundary).sum())

    def _latent_stats(self, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The VAE's per-channel ``latents_mean`` and ``1 / latents_std``, (1, C, 1, 1, 1)."""
        vae = self.pipe.vae
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(device, dtype)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(device, dtype)
        return mean, inv_std

    def start_chunk(self, state: RequestState, previous: np.ndarray) -> None:
        """Next chunk of a stream: its last frame of `previous` (uint8 (F, H, W, 3)) is encoded
        as a one-frame clip by the causal VAE (its posterior mode, normalised as diffusers
        normalises latents) and fixed as latent frame 0 of fresh latents from the request's
        generator (`video_chunks.ChunkCondition`): clean with timestep-0 tokens when the
        pipeline has ``expand_timesteps`` (Wan 2.2 TI2V's first-frame conditioning), else by
        the replacement method; a fresh scheduler with the request's timesteps."""
        vae = self.pipe.vae
        tail = frames_to_video_tensor(previous[-self.chunk_overlap_frames:], self.device, vae.dtype)
        encoded = vae.encode(tail).latent_dist.mode().float()  # (1, C, 1, h, w)
        mean, inv_std = self._latent_stats(torch.float32, encoded.device)
        clean = (encoded - mean) * inv_std
        latents = self._noise(state)
        self._new_schedule(state)
        sigmas = state.scheduler.sigmas.to(torch.float32)  # flow sigmas, (num_steps + 1,), last 0
        state.chunk_condition = ChunkCondition(clean=clean, noise=latents[:, :, :clean.shape[2]].clone(),
                                               sigmas=sigmas, clean_tokens=self.expand_timesteps)
        state.latents = state.chunk_condition.apply(latents, 0)

    def step_key(self, state: RequestState):
        """The expert of the request's next step (0 high-noise, 1 low-noise); None with one
        expert or when done."""
        if self.boundary is None or state.done:
            return None
        return self._expert(state)

    def _expert(self, state: RequestState) -> int:
        """0 (high noise) while the step's timestep >= the boundary, else 1; read from the step
        count fixed with the schedule, so a step reads no timestep back from the device."""
        return 0 if self.boundary is None or state.step_index < state.extra[HIGH_NOISE_STEPS] else 1

    # ------------------------------------------------------------------ per step
    def denoise(self, batch: StepBatch, call: DenoiserCall | None = None) -> torch.Tensor:
        """`PipelineAdapter.denoise`; with context folding the cross-attention processors
        are unfolded again afterwards, so the shared transformer computes stock diffusers
        outside the adapter's forwards (e.g. a diffusers pipeline built on the same modules)."""
        if not self.context_folding:
            return super().denoise(batch, call)
        try:
            return super().denoise(batch, call)
        finally:
            for expert in self.experts:
                wan_context_folding.set_max_sequence_length(expert, None)

    def collate(self, states: list[RequestState]) -> StepBatch:
        """`PipelineAdapter.collate`; with ``expand_timesteps``, when a request of the batch is a
        stream chunk conditioned on clean latent frames, also ``known_latent_frames``: (rows,)
        long, each row's number of such frames (0 for the others), a per-row input so that a
        split of the rows (CFG parallel) keeps it with its rows; `denoise_kwargs` turns it into
        timestep 0 for those frames' tokens."""
        batch = super().collate(states)
        if self.expand_timesteps and any(s.chunk_condition is not None for s in states):
            known = torch.tensor([s.chunk_condition.num_frames if s.chunk_condition is not None else 0
                                  for s, n in zip(states, batch.row_counts) for _ in range(n)],
                                 device=batch.latents.device)
            batch.inputs = {**batch.inputs, "known_latent_frames": known.repeat(batch.branches)}
        return batch

    def denoise_kwargs(self, batch: StepBatch) -> dict[str, Any]:
        """The batch's inputs (latents cast to the transformer dtype, as diffusers does per
        call); with two experts also ``expert`` (its index: an input of the call, so a captured
        CUDA graph is one expert's); with context folding also ``folded_context_length`` (the
        requests' ``max_sequence_length``: the rows the folded context stands for, set on the
        cross-attention processors here; an input of the call too, for the same reason).

        Raises:
            ValueError: the batch mixes experts (the request scheduler keeps them apart).
        """
        inputs = dict(batch.inputs)
        if self.context_folding:
            length = batch.states[0].params.max_sequence_length  # one per batch (batch key)
            for expert in self.experts:
                wan_context_folding.set_max_sequence_length(expert, length)
            inputs["folded_context_length"] = length
        inputs["hidden_states"] = inputs["hidden_states"].to(self.experts[0].dtype)  # float32 latents
        if self.expand_timesteps:  # one timestep per patch token (Wan 2.2 TI2V), float as diffusers'
            _, _, f, h, w = inputs["hidden_states"].shape
            p_t, p_h, p_w = self.experts[0].config.patch_size
            known = inputs.pop("known_latent_frames", None)  # (rows,): a stream chunk's clean frames, see `collate`
            inputs["timestep"] = per_token_timesteps(inputs["timestep"], None if known is None else known // p_t,
                                                     f // p_t, (h // p_h) * (w // p_w))
        if len(self.experts) > 1:
            experts = {self._expert(s) for s in batch.states}
            if len(experts) > 1:
                raise ValueError("requests on different Wan 2.2 experts cannot share a forward")
            inputs["expert"] = experts.pop()
        return inputs

    def call_denoiser(self, batch: StepBatch, kwargs: dict[str, Any]) -> torch.Tensor:
        """The expert ``kwargs["expert"]`` (default the only one) on the other inputs (with
        context folding, for ``kwargs["folded_context_length"]`` context rows)."""
        kwargs = dict(kwargs)
        expert = self.experts[kwargs.pop("expert", 0)]
        length = kwargs.pop("folded_context_length", None)
        if length is not None:
            wan_context_folding.set_max_sequence_length(expert, length)
        return expert(**kwargs, return_dict=False)[0]

    def step(self, batch: StepBatch, guided: torch.Tensor) -> dict[str, BaseException]:
        """The diffusion-scheduler step, then a stream chunk's conditioning frames are put back
        at the next step's noise level (`video_chunks.ChunkCondition.apply`)."""
        failures = super().step(batch, guided)
        for state in batch.states:
            if state.chunk_condition is not None and state.request_id not in failures:
                state.latents = state.chunk_condition.apply(state.latents, state.step_index)
        return failures

    def combine(self, batch: StepBatch, out: torch.Tensor) -> torch.Tensor:
        """CFG with each request's weight for its expert (guidance_scale, or guidance_scale_2
        on the low-noise expert)."""
        if batch.branches == 1:
            return out
        uncond, cond = out.chunk(2)
        weights = [s.params.guidance_scale if self._expert(s) == 0 else s.params.guidance_scale_2
                   for s in batch.states]
        return guidance.cfg(uncond, cond, guidance.uniform_or_rows(weights, batch.row_values))

    # ------------------------------------------------------------------ decode
    def decode(self, state: RequestState, latents: torch.Tensor | None = None) -> list[Any]:
        """Denormalise (``latents * std + mean`` as diffusers writes it), VAE-decode each video
        and post-process with diffusers' `VideoProcessor`. Returns one entry per video: a uint8
        array (F, H, W, 3) for ``"np"``, a uint8 tensor (F, H, W, 3) for ``"pt"``, a list of
        PIL frames for ``"pil"``, the latents (C, F_lat, h, w) for ``"latent"``.

        Raises:
            NonFiniteOutputError: the decoded pixels hold NaN/inf.
        """
        latents = state.latents if latents is None else latents
        output_type = state.params.output_type
        if output_type == "latent":
            return list(latents)
        vae = self.pipe.vae
        latents = latents.to(vae.dtype)
        mean, inv_std = self._latent_stats(latents.dtype, latents.device)
        latents = latents / inv_std + mean
        videos = []
        for row in latents.split(1):  # one video at a time bounds the decoder's activations
            video = checked_pixels(vae.decode(row, return_dict=False)[0])
            if output_type == "pil":
                videos.extend(self.pipe.video_processor.postprocess_video(video, output_type="pil"))
                continue
            frames = self.pipe.video_processor.postprocess_video(video, output_type="np")[0]
            frames = (frames * 255).round().astype(np.uint8)  # as diffusers' numpy_to_pil
            videos.append(torch.from_numpy(frames) if output_type == "pt" else frames)
        return videos
