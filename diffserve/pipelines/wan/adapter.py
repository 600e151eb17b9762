"""Adapter for Wan text-to-video (`WanPipeline` folders: Wan 2.1 T2V, Wan 2.2 T2V / TI2V).

Wan (Wan team 2025, "Wan: Open and Advanced Large-Scale Video Generative Models",
arXiv:2503.20314): a UMT5 text encoder, a `WanTransformer3DModel` DiT with 3-D RoPE over
(frames, height, width) patches, the causal 3-D VAE `AutoencoderKLWan` (8x spatial, 4x
temporal down-sampling: F = 4k + 1 frames -> k + 1 latent frames) and a flow-matching
scheduler (the folders ship `UniPCMultistepScheduler` with flow sigmas and ``flow_shift``).
Wan 2.2 A14B (``boundary_ratio`` in ``model_index.json``) has two experts: ``transformer``
denoises the steps with timestep >= ``boundary_ratio * num_train_timesteps`` (high noise) with
``guidance_scale``, ``transformer_2`` the rest with ``guidance_scale_2``; requests on different
experts never share a forward (the declared `diffserve.pipelines.experts.ExpertRouting`). Prompt
encoding, latents, timesteps and video post-processing reuse diffusers' `WanPipeline` methods on
the same components, so a video equals diffusers' for the same seed (tests/pipelines/test_wan.py).

With context folding (``EngineConfig.context_folding``, on by default) the zero padding rows of
the prompts run as one row with an attention bias (:mod:`diffserve.pipelines.wan.context_folding`,
an exact identity): the cross-attention sees the batch's longest prompt plus one row instead of
``max_sequence_length`` rows.

Streams (``num_chunks``): each chunk after the first has its first latent frame fixed to the
previous chunk's last frame, re-encoded by the causal VAE: clean with timestep-0 tokens on
folders with ``expand_timesteps`` (Wan 2.2 TI2V's first-frame conditioning), else by the
replacement method (see `diffserve.pipelines.video_chunks`); interactions swap the conditional
branch's UMT5 states.

Requests of different sizes AND frame counts share a forward (`mixed_sizes`,
`diffserve.pipelines.token_spans`, `wan/mixed_sizes.py`): collation pads each request's latents
at the end of each axis to the batch's largest grid; Wan's per-axis rotary keeps every real
token at its solo position, and a self-attention key mask hides each row's padded tokens. In
eager forwards each block runs once per row size on real tokens only (length groups,
``EngineConfig.length_groups``).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import numpy as np
import torch
from diffusers import WanPipeline
from diffusers.pipelines.wan.pipeline_wan import prompt_clean

from diffserve.core.errors import UnsupportedModelError
from diffserve.pipelines.base import PipelineAdapter, RequestState, StepBatch, checked_pixels
from diffserve.pipelines.capabilities import CacheDiTSupport, Capabilities
from diffserve.pipelines.experts import ExpertRouting
from diffserve.pipelines.text_encoding import TextEncoder
from diffserve.pipelines.token_spans import LATENT_SIZE, latent_rows
from diffserve.pipelines.video_chunks import ChunkCondition, frames_to_video_tensor, per_token_timesteps
from diffserve.pipelines.wan import context_folding
from diffserve.pipelines.wan.mixed_sizes import install_token_spans, zero_outside
from diffserve.pipelines.wan.teacache import teacache_support

logging.getLogger("diffusers.pipelines.wan.pipeline_wan").setLevel(logging.ERROR)

#: ``RequestState.row_data`` key: the clean latent frames a stream chunk starts with (0 for
#: other requests), which get timestep-0 tokens on ``expand_timesteps`` folders.
KNOWN_LATENT_FRAMES = "known_latent_frames"


class WanAdapter(PipelineAdapter):
    """Step-contract adapter over a diffusers `WanPipeline`.

    Tensors: latents (N, C, F_lat, H/8, W/8) float32 as diffusers keeps them (cast to the
    transformer dtype per forward); per branch encoder_hidden_states (N, max_sequence_length,
    text_dim) zero-padded UMT5 states in the model dtype, or with context folding (N, K, text_dim):
    the rows up to the prompt's last token plus one zero row standing for the rest (a batch is
    right-padded with zero rows to its longest K). CFG branches: [negative, positive], one
    forward for both (diffusers runs two). Timestep: the scheduler's raw timestep (0..1000) per
    row, or per patch token with ``expand_timesteps`` (Wan 2.2 TI2V). Rows of different sizes
    or frame counts: latents zero-padded at the end of each axis to the batch's largest
    (F_lat, h, w), each request's own size its row data `token_spans.LATENT_SIZE`
    (`wan.mixed_sizes`).
    """

    pipeline_class_name = "WanPipeline"
    pipeline_class = WanPipeline
    # diffusers' WanPipeline.__call__ defaults (480x832, 81 frames, 50 steps, CFG 5, 512 tokens)
    # and Wan 2.1's 16 frames per second (the Wan repository's sample_fps)
    sampling_defaults = {"height": 480, "width": 832, "num_frames": 81, "num_inference_steps": 50,
                         "guidance_scale": 5.0, "max_sequence_length": 512, "fps": 16}
    #: prompts are zero-padded to the UMT5 length and attended without a mask (with context
    #: folding it sets the folded row's count)
    batch_key_fields = ("max_sequence_length",)
    chunk_streaming = True
    chunk_overlap_frames = 1
    per_request_samplers = True
    mixed_sizes = True

    def setup(self) -> dict[str, Any]:
        """The experts (two on Wan 2.2 A14B folders: `expert_routing`), context folding of the
        prompts' padding rows, UMT5 encoding, TeaCache / cache-dit on Wan 2.1-layout folders and
        regional compile everywhere."""
        pipe = self.pipe
        transformer = pipe.transformer
        self.experts = [transformer] if pipe.transformer_2 is None else [transformer, pipe.transformer_2]
        ratio = pipe.config.boundary_ratio
        if len(self.experts) == 2:
            if ratio is None:
                raise UnsupportedModelError(f"{self.options.model_dir}: a WanPipeline with transformer_2 needs "
                                            "boundary_ratio in model_index.json")
            self.expert_routing = ExpertRouting(self.experts, ratio * pipe.scheduler.config.num_train_timesteps)
        self.expand_timesteps = bool(pipe.config.expand_timesteps)
        #: whether the zero padding rows of the prompts run as one row (text-to-video experts)
        self.context_folding = self.options.context_folding and all(
            context_folding.supports_folding(e) for e in self.experts)
        if self.context_folding:
            for expert in self.experts:
                context_folding.install_folded_cross_attention(expert)
            # prompts of different lengths are right-padded with zero rows (exact: the padding is
            # zero rows either way; no mask)
            self.padded_inputs = {"encoder_hidden_states": (None, 0.0)}
        self.text = TextEncoder(self, self._encode_text, [(pipe.tokenizer, None)],
                                key=("folded" if self.context_folding else "full",), clean=prompt_clean)
        # TeaCache and cache-dit for one expert with one timestep per row (Wan 2.1 layout: the
        # TeaCache4Wan2.1 coefficients; WanTransformerBlock(hidden_states, encoder_hidden_states,
        # ...) -> hidden_states: cache-dit's Pattern_2, as its own Wan adapter declares)
        plain = len(self.experts) == 1 and not self.expand_timesteps and transformer.config.image_dim is None
        self.capabilities = Capabilities(
            teacache=teacache_support(transformer) if plain else None,
            cache_dit=CacheDiTSupport(blocks=("blocks",), patterns=("Pattern_2",), has_encoder_residual=False)
            if plain else None,
            repeated_blocks=("WanTransformerBlock",))
        # length groups: eager mixed forwards run each block per row size on real tokens only
        self.mixed_sizes = self.mixed_sizes and all(install_token_spans(e, self.grouping) for e in self.experts)
        p_t, p_h, _ = transformer.config.patch_size
        spatial, temporal = pipe.vae_scale_factor_spatial, pipe.vae_scale_factor_temporal
        rope = transformer.config.rope_max_seq_len  # RoPE positions per axis, in patches
        # Wan's UMT5 context length is 512 (``text_len`` in the Wan repository)
        # diffusers' WanPipeline.check_inputs: multiples of 16 (also with a 4x VAE, as digits-video's)
        return {"resolution_factor": math.lcm(16, spatial * p_h), "max_sequence_length_limit": 512,
                "max_height": rope * p_h * spatial, "max_width": rope * p_h * spatial, "frame_factor": temporal,
                "max_num_frames": (rope * p_t - 1) * temporal + 1}

    # --------------------------------------------------------------- per request
    def _encode_text(self, text: str, max_sequence_length: int | None):
        """diffusers' Wan encoding of one text: (1, max_sequence_length, text_dim), the UMT5
        states of its tokens then zeros, in the transformer dtype; with context folding cut to
        (1, K, text_dim) after its first padding row (`context_folding.fold_padding_rows`)."""
        pe, _ = self.pipe.encode_prompt(prompt=text, do_classifier_free_guidance=False, num_videos_per_prompt=1,
                                        max_sequence_length=max_sequence_length, device=self.device)
        pe = pe.to(self.experts[0].dtype)
        return (context_folding.fold_padding_rows(pe) if self.context_folding else pe,)

    def prepare_request(self, state: RequestState) -> None:
        """Encode prompt (and negative prompt under CFG) through the cache, draw float32 latents
        (N, C, F_lat, h, w) exactly as diffusers does, and create the request's own scheduler;
        with context folding the request's text length is its row data (the folded row stands
        for the rest, `context_folding.FoldedCrossAttnProcessor`)."""
        state.branches = self.text_branches(state)
        if self.context_folding:
            state.row_data[context_folding.FOLDED_CONTEXT_LENGTH] = state.params.max_sequence_length
        state.latents = self._noise(state)
        self._new_schedule(state)
        if self.mixed_sizes:
            state.row_data[LATENT_SIZE] = tuple(state.latents.shape[2:])

    def _noise(self, state: RequestState) -> torch.Tensor:
        """Initial latents (N, C, F_lat, h, w) float32 from the request's generator, as diffusers
        draws them."""
        p = state.params
        return self.pipe.prepare_latents(p.num_images_per_prompt, self.experts[0].config.in_channels, p.height,
                                         p.width, p.num_frames, torch.float32, self.device, state.generator)

    def _new_schedule(self, state: RequestState) -> None:
        """A fresh diffusion scheduler (`request_scheduler`) with the request's timesteps; step 0."""
        scheduler = self.request_scheduler(state.params)
        scheduler.set_timesteps(state.params.num_inference_steps, device=self.device)
        scheduler.set_begin_index(0)
        self.set_schedule(state, scheduler, scheduler.timesteps)

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
        pipeline has ``expand_timesteps`` (Wan 2.2 TI2V's first-frame conditioning; the frame
        count is the request's row data), else by the replacement method; a fresh scheduler
        with the request's timesteps."""
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
        if self.expand_timesteps:
            state.row_data[KNOWN_LATENT_FRAMES] = state.chunk_condition.num_frames
        state.latents = state.chunk_condition.apply(latents, 0)

    # ------------------------------------------------------------------ per step
    def forward_inputs(self, batch: StepBatch) -> dict[str, Any]:
        """The batch's inputs, latents cast to the transformer dtype (as diffusers does per
        call); with ``expand_timesteps`` one timestep per patch token (float, as diffusers'),
        0 on the tokens of a stream chunk's clean latent frames (`KNOWN_LATENT_FRAMES`)."""
        inputs = dict(batch.inputs)
        inputs["hidden_states"] = inputs["hidden_states"].to(self.experts[0].dtype)  # float32 latents
        if self.expand_timesteps:
            _, _, f, h, w = inputs["hidden_states"].shape
            p_t, p_h, p_w = self.experts[0].config.patch_size
            known = None
            if KNOWN_LATENT_FRAMES in batch.row_data:
                known = batch.row_data.tensor(KNOWN_LATENT_FRAMES, torch.long, batch.latents.device) // p_t
            inputs["timestep"] = per_token_timesteps(inputs["timestep"], known, f // p_t, (h // p_h) * (w // p_w))
        return inputs

    def combine(self, batch: StepBatch, out: torch.Tensor) -> torch.Tensor:
        """The guided prediction (`PipelineAdapter.combine`), zero outside each request's own
        region when the batch's latents are padded (`wan.mixed_sizes.zero_outside`: padded
        latents stay zero)."""
        guided = super().combine(batch, out)
        if batch.latent_sizes is None:
            return guided
        return zero_outside(guided, latent_rows(batch.row_data, batch.num_latent_rows))

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
