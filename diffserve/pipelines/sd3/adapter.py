"""Adapter for the Stable Diffusion 3 family (`StableDiffusion3Pipeline` folders).

SD3 / SD3.5 (Esser et al. 2024, "Scaling Rectified Flow Transformers", arXiv:2403.03206):
an MMDiT `SD3Transformer2DModel`, two CLIP text encoders plus an optional T5, an
`AutoencoderKL` and a `FlowMatchEulerDiscreteScheduler`. Prompt encoding, latent preparation
and timesteps reuse diffusers' own `StableDiffusion3Pipeline` methods on the same components,
so an image equals diffusers' for the same seed (see tests/pipelines/test_sd3.py).

A request with an input image runs `StableDiffusion3Img2ImgPipeline` semantics on the same
folder (the image is VAE-encoded, noised to the strength's first timestep, and only the last
``strength`` fraction of the schedule runs); such requests share forwards with text-to-image
ones of the same size.

Requests of different sizes share a forward (`mixed_sizes`, `diffserve.pipelines.token_spans`,
`sd3/mixed_sizes.py`): each row keeps its own position embedding and attention span. Off for
SD3.5's dual-attention folders (their image-only attention is not span-aware yet) and under
Ulysses sequence parallelism (its processors shard the padded strip).
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Any

import torch
from diffusers import StableDiffusion3Img2ImgPipeline, StableDiffusion3Pipeline
from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import calculate_shift, retrieve_timesteps

from diffserve.core.errors import InvalidRequestError
from diffserve.core.sampling_params import SamplingParams
from diffserve.pipelines.base import CacheDiTSupport, Capabilities, PipelineAdapter, RequestState, checked_pixels
from diffserve.pipelines.sd3 import context_folding
from diffserve.pipelines.sd3.mixed_sizes import install_token_spans
from diffserve.pipelines.sd3.teacache import TEACACHE
from diffserve.pipelines.step_batch import StepBatch
from diffserve.pipelines.text_encoding import TextEncoder
from diffserve.pipelines.token_spans import IMAGE_TOKENS, LATENT_SIZE, strip_layout

# diffserve reports truncation itself (GenerationOutput.prompt_truncated); diffusers' own warning
# echoes the whole cut text on every encode.
logging.getLogger("diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3").setLevel(logging.ERROR)

#: diffusers' StableDiffusion3Pipeline.__call__ T5 budget (also the folded row count).
DEFAULT_MAX_SEQUENCE_LENGTH = 256




class StableDiffusion3Adapter(PipelineAdapter):
    """Step-contract adapter over a diffusers `StableDiffusion3Pipeline`.

    Tensors: latents (N, C_latent, H/f_vae, W/f_vae); per branch prompt_embeds
    (N, L_clip + max_sequence_length, joint_attention_dim) (L_clip + 1 with context folding)
    and pooled (N, pooled_dim); all in the model dtype. CFG branches: [negative, positive].
    """

    pipeline_class_name = "StableDiffusion3Pipeline"
    pipeline_class = StableDiffusion3Pipeline
    optional_components = ("text_encoder_3", "tokenizer_3")
    # diffusers' StableDiffusion3Pipeline.__call__ defaults; StableDiffusion3Img2ImgPipeline's strength
    sampling_defaults = {"num_inference_steps": 28, "guidance_scale": 7.0,
                         "max_sequence_length": DEFAULT_MAX_SEQUENCE_LENGTH, "strength": 0.6}
    #: the T5 budget sets the text length (and the fold count with folding)
    batch_key_fields = ("max_sequence_length",)
    image_input = "optional"
    text_inputs = ("encoder_hidden_states", "pooled_projections")
    per_request_samplers = True

    def setup(self) -> dict[str, Any]:
        """The image-to-image pipeline on the same modules, context folding of the zero T5 rows
        (folders without T5), CLIP (+ T5) encoding in batches, TeaCache, cache-dit, regional
        compile and the Ulysses plan."""
        pipe = self.pipe
        self.img2img = StableDiffusion3Img2ImgPipeline(**{k: v for k, v in pipe.components.items()
                                                          if k not in ("image_encoder", "feature_extractor")})
        self.img2img.set_progress_bar_config(disable=True)
        self.context_folding = self.options.context_folding and pipe.text_encoder_3 is None
        if self.context_folding:
            context_folding.install_folded_context_attention(pipe.transformer, DEFAULT_MAX_SEQUENCE_LENGTH)
        self.text = TextEncoder(
            self, self._encode_text,
            [(pipe.tokenizer, pipe.tokenizer_max_length), (pipe.tokenizer_2, pipe.tokenizer_max_length),
             (pipe.tokenizer_3, None)],
            key=("folded" if self.context_folding else "full",), batched=True,
        )
        self.capabilities = Capabilities(
            teacache=TEACACHE,
            # JointTransformerBlock takes (hidden_states, encoder_hidden_states) and returns
            # (encoder_hidden_states, hidden_states): cache-dit's Pattern_1 (its own SD3 adapter
            # uses it); the last block is context_pre_only (no encoder stream out).
            cache_dit=CacheDiTSupport(blocks=("transformer_blocks",), patterns=("Pattern_1",),
                                      has_encoder_residual=False),
            # diffusers 0.42's SD3Transformer2DModel does not declare _repeated_blocks
            repeated_blocks=("JointTransformerBlock",),
            context_parallel=self._context_parallel,
        )
        self.mixed_sizes = not pipe.transformer.config.get("dual_attention_layers")
        if self.mixed_sizes:
            install_token_spans(pipe.transformer, folded=self.context_folding, grouped=self.grouping)
        pos_max = pipe.transformer.config.get("pos_embed_max_size")
        # PatchEmbed crops a pos_embed_max_size^2 grid of positions: larger inputs fail
        max_side = None if pos_max is None else pos_max * pipe.patch_size * pipe.vae_scale_factor
        # image-to-image noises the input with the scheduler's scale_noise (flow-matching Euler's)
        image_samplers = tuple(n for n in self.samplers.available() if hasattr(self.samplers.template(n), "scale_noise"))
        # T5's positional budget in SD3: diffusers refuses more than 512
        return {"resolution_factor": pipe.vae_scale_factor * pipe.patch_size, "max_sequence_length_limit": 512,
                "max_prompt_tokens": pipe.tokenizer_max_length, "max_height": max_side, "max_width": max_side,
                "image_samplers": image_samplers}

    def _context_parallel(self, transformer: torch.nn.Module) -> dict:
        """The Ulysses plan (`sd3.context_parallel`); requests then batch by size again
        (`parallel.ulysses.enable_ulysses`: its processors shard the sequence without token
        spans)."""
        from diffserve.pipelines.sd3.context_parallel import prepare_sd3_context_parallel

        return prepare_sd3_context_parallel(transformer)

    def check_params(self, params: SamplingParams, inputs) -> None:
        """At most one input image and no mask; strength needs an image and must leave at
        least one step as diffusers counts them (`num_steps`: any strength in (0, 1] does
        unless it is below ~1e-15 x num_inference_steps, where the float count rounds to none)."""
        super().check_params(params, inputs)
        if inputs is None or not inputs.images:
            if params.strength is not None:
                raise InvalidRequestError("strength", params.strength, "unset without an input image")
            return
        if self.num_steps(params, inputs) < 1:
            raise InvalidRequestError("strength", self._strength(params), "large enough to leave one denoising step "
                                      f"of {params.num_inference_steps} (e.g. 1e-6 or more)")

    def _strength(self, params: SamplingParams) -> float:
        return self.spec.default_strength if params.strength is None else params.strength

    def num_steps(self, params: SamplingParams, inputs=None) -> int:
        """Image-to-image runs the last ``strength`` of the schedule: N - int(N - min(N x
        strength, N)) steps, as `StableDiffusion3Img2ImgPipeline.get_timesteps` counts them."""
        if inputs is None or not inputs.images:
            return params.num_inference_steps
        n = params.num_inference_steps
        return n - int(max(n - min(n * self._strength(params), n), 0))

    def max_clip_skip(self) -> int | None:
        return self.clip_layers_skippable(self.pipe.text_encoder, self.pipe.text_encoder_2)

    def timestep_arguments(self, scheduler: Any, num_steps: int) -> dict[str, Any]:
        """``mu`` for dynamically shifted schedules (as diffusers' SD3 ``__call__``)."""
        return {"mu": 1.0} if scheduler.config.get("use_dynamic_shifting", None) else {}

    def _encode_text(self, text: str | list[str], max_sequence_length: int | None, clip_skip: int | None = None):
        """diffusers' SD3 encoding of a text (or of n texts, a row each: every encoder pads to
        a fixed length, so a row equals the text alone), with `clip_skip` for the CLIP
        encoders: prompt_embeds (n, L_clip + L_t5, D) (L_t5 = 1 folded row with context
        folding) and pooled (n, P)."""
        pe, _, pooled, _ = self.pipe.encode_prompt(
            prompt=text, prompt_2=None, prompt_3=None, do_classifier_free_guidance=False,
            num_images_per_prompt=1, device=self.device, max_sequence_length=max_sequence_length,
            clip_skip=clip_skip,
        )
        if self.context_folding:
            pe = context_folding.fold_placeholder_rows(pe, self.pipe.tokenizer_max_length)
        return pe, pooled

    def prepare_request(self, state: RequestState) -> None:
        """Encode prompt (and negative prompt with CFG) through the cache, draw latents
        (N, C, H/f, W/f) exactly as diffusers does, and create the request's own scheduler."""
        p, pipe = state.params, self.pipe
        state.branches = self.text_branches(state)
        if self.context_folding:
            state.shared = {"joint_attention_kwargs": {"fold_count": p.max_sequence_length}}
        dtype = state.branches[-1]["encoder_hidden_states"].dtype
        scheduler = self.request_scheduler(p)
        kwargs = {}
        if scheduler.config.get("use_dynamic_shifting", None):
            patch, f = pipe.transformer.config.patch_size, pipe.vae_scale_factor
            kwargs["mu"] = calculate_shift(
                (p.height // f // patch) * (p.width // f // patch),
                scheduler.config.get("base_image_seq_len", 256),
                scheduler.config.get("max_image_seq_len", 4096),
                scheduler.config.get("base_shift", 0.5),
                scheduler.config.get("max_shift", 1.16),
            )
        if state.inputs is not None and state.inputs.images:
            self._prepare_img2img(state, scheduler, kwargs, dtype)
        else:
            state.latents = pipe.prepare_latents(p.num_images_per_prompt, pipe.transformer.config.in_channels,
                                                 p.height, p.width, dtype, self.device, state.generator)
            timesteps, _ = retrieve_timesteps(scheduler, p.num_inference_steps, self.device, **kwargs)
            self.set_schedule(state, scheduler, timesteps)
        if self.mixed_sizes:
            h, w = state.latents.shape[-2:]
            patch = pipe.transformer.config.patch_size
            state.row_data[LATENT_SIZE] = (h, w)
            state.row_data[IMAGE_TOKENS] = (h // patch) * (w // patch)

    def forward_inputs(self, batch: StepBatch) -> dict[str, Any]:
        """The collated inputs; rows of different sizes as a `token_spans.TokenLayout` strip."""
        layout = self._layout(batch)
        if layout is None:
            return batch.inputs
        attention = {**(batch.inputs.get("joint_attention_kwargs") or {}), "spans": True}  # the processors mask
        return {**batch.inputs, "hidden_states": layout.to_strip(batch.inputs["hidden_states"]),
                "joint_attention_kwargs": attention}

    def denoise(self, batch: StepBatch, call=None) -> torch.Tensor:
        """The forward (`PipelineAdapter.denoise`); a strip's prediction back in the batch's
        padded latent layout."""
        out = super().denoise(batch, call)
        layout = self._layout(batch)
        return out if layout is None else layout.from_strip(out)

    def _layout(self, batch: StepBatch):
        if batch.latent_sizes is None:
            return None
        grid = tuple(batch.inputs["hidden_states"].shape[-2:])
        return strip_layout(batch.row_data, grid, self.pipe.transformer.config.patch_size)

    @contextmanager
    def _img2img_with(self, scheduler):
        """The img2img pipeline with the request's own scheduler (prepare runs on one thread)."""
        shared = self.img2img.scheduler
        self.img2img.scheduler = scheduler
        try:
            yield self.img2img
        finally:
            self.img2img.scheduler = shared

    def _prepare_img2img(self, state: RequestState, scheduler, kwargs: dict, dtype: torch.dtype) -> None:
        """`StableDiffusion3Img2ImgPipeline`'s timesteps (the last ``strength`` of the schedule)
        and latents (the VAE-encoded image noised to the first of them), drawn from the
        request's generator in diffusers' order."""
        p = state.params
        image = state.inputs.images[0]
        if self.pipe.vae.config.in_channels == 1:
            image = image.convert("L")
        with self._img2img_with(scheduler) as pipe:
            pixels = pipe.image_processor.preprocess(image, height=p.height, width=p.width)
            retrieve_timesteps(scheduler, p.num_inference_steps, self.device, **kwargs)
            timesteps, _ = pipe.get_timesteps(p.num_inference_steps, self._strength(p), self.device)
            latent_timestep = timesteps[:1].repeat(p.num_images_per_prompt)
            if isinstance(state.generator, list):  # one image row per generator, each encoded with its own
                pixels = pixels.repeat(len(state.generator), 1, 1, 1)
            state.latents = pipe.prepare_latents(pixels, latent_timestep, 1, p.num_images_per_prompt, dtype,
                                                 self.device, state.generator)
        self.set_schedule(state, scheduler, timesteps, begin=len(scheduler.timesteps) - len(timesteps))

    def decode(self, state: RequestState, latents: torch.Tensor | None = None) -> Any:
        """Unscale (latents / scaling_factor + shift_factor), VAE-decode and post-process to
        the request's output_type (PIL list, float32 (N, H, W, C) array in [0, 1], ...)."""
        latents = state.latents if latents is None else latents
        if state.params.output_type == "latent":
            return latents
        return self._postprocess(state, self._vae_decode(latents))

    def _vae_decode(self, latents: torch.Tensor) -> torch.Tensor:
        vae = self.pipe.vae
        latents = latents / vae.config.scaling_factor + (vae.config.shift_factor or 0.0)
        return vae.decode(latents.to(vae.dtype), return_dict=False)[0]

    def _postprocess(self, state: RequestState, image: torch.Tensor) -> Any:
        return self.pipe.image_processor.postprocess(checked_pixels(image), output_type=state.params.output_type)

    def decode_many(self, states: list[RequestState], latents: list[torch.Tensor]) -> list[Any]:
        """One VAE forward for all requests whose latents share a shape (the usual case when a
        step batch finishes together); each request's pixels are checked and post-processed on
        their own. A subclass that overrides `decode` keeps its own decode, one per request."""
        if type(self).decode is not StableDiffusion3Adapter.decode:
            return super().decode_many(states, latents)
        groups: dict[tuple, list[int]] = {}
        for i, (state, x) in enumerate(zip(states, latents)):
            if state.params.output_type != "latent":
                groups.setdefault(tuple(x.shape[1:]), []).append(i)
        results: list[Any] = [x if s.params.output_type == "latent" else None for s, x in zip(states, latents)]
        for members in groups.values():
            try:
                images = self._vae_decode(torch.cat([latents[i] for i in members]))
            except Exception as exc:  # noqa: BLE001 - fall back to one decode each
                if len(members) == 1:
                    results[members[0]] = exc
                    continue
                for i in members:
                    results[i] = self.decode_many([states[i]], [latents[i]])[0]
                continue
            at = 0
            for i in members:
                n = latents[i].shape[0]
                try:
                    results[i] = self._postprocess(states[i], images[at:at + n])
                except Exception as exc:  # noqa: BLE001
                    results[i] = exc
                at += n
        return results
