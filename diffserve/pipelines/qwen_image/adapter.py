"""Adapter for Qwen-Image (`QwenImagePipeline` folders).

Qwen-Image (Qwen team 2025, "Qwen-Image Technical Report", arXiv:2508.02324): an MMDiT
`QwenImageTransformer2DModel` with 3-D RoPE, a Qwen2.5-VL text encoder, the Wan-style
`AutoencoderKLQwenImage` (latents normalised by per-channel ``latents_mean``/``latents_std``) and a
`FlowMatchEulerDiscreteScheduler` with dynamic shifting. Prompt encoding, latents, timesteps and
unpacking reuse diffusers' own `QwenImagePipeline` methods on the same components, so an image
equals diffusers' for the same seed (tests/pipelines/test_qwen_image.py).

What differs from SD3 and how it maps onto the step contract:

- Text is VARIABLE length (the encoder keeps the prompt's tokens after a fixed template prefix).
  Each text is encoded alone (one row, no mask, as diffusers does for one prompt); a step batch
  right-pads ``encoder_hidden_states`` with zeros to its longest text and passes
  ``encoder_hidden_states_mask`` (`padded_inputs`). The transformer masks padded keys in its joint
  attention and gives text token i RoPE position ``max_vid_index + i`` whatever the padding, so a
  padded row equals its unpadded solo run within float rounding (measured ~5e-7): text length is
  NOT part of the batch key. An unpadded batch gets no mask (diffusers' rule: an all-ones mask
  becomes None), keeping the fast unmasked attention kernels.
- True CFG with norm rescale (`guidance.cfg_norm_rescaled`), on when ``true_cfg_scale > 1`` and a
  negative prompt is given (``""`` counts, as in diffusers); ``guidance_scale`` is refused:
  diffusers 0.42.1's transformer cannot run guidance-distilled (``guidance_embeds``) weights, so
  such folders are refused at load.
- Latents are packed 2x2 ``(N, h*w/4, 4C)``; ``img_shapes`` (one ``[(1, h/2, w/2)]`` list per
  row) tells the transformer the grid; the timestep goes in as ``t / 1000``.
- Requests of different sizes share a forward (`mixed_sizes`, `diffserve.pipelines.token_spans`,
  `qwen_image/mixed_sizes.py`; transformers with a plain time embedding): each request's packed
  sequence is right-padded to the batch's longest, and every row keeps its own image and text
  RoPE positions and attention span; in eager forwards each block runs once per row size on
  real tokens only (`length_groups`, ``EngineConfig.length_groups``).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch
from diffusers import QwenImagePipeline
from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift, retrieve_timesteps

from diffserve.core.errors import UnsupportedModelError
from diffserve.pipelines.base import PipelineAdapter, RequestState, StepBatch, checked_pixels
from diffserve.pipelines.capabilities import CacheDiTSupport, Capabilities
from diffserve.pipelines.guidance import TRUE_CFG_NORM_RESCALED
from diffserve.pipelines.qwen_image.mixed_sizes import install_token_spans, set_token_span, span_inputs
from diffserve.pipelines.qwen_image.teacache import TEACACHE
from diffserve.pipelines.text_encoding import TextEncoder

# diffserve decides guidance itself; diffusers warns on every call with true_cfg_scale > 1 and no
# negative prompt (its default).
logging.getLogger("diffusers.pipelines.qwenimage").setLevel(logging.ERROR)

#: diffusers' check_inputs refuses a longer text budget (the pipeline's tokenizer_max_length).
MAX_SEQUENCE_LENGTH_LIMIT = 1024


class QwenImageAdapter(PipelineAdapter):
    """Step-contract adapter over a diffusers `QwenImagePipeline`.

    Tensors: latents (N, (H/16)*(W/16), 4*C_latent) packed, in the model dtype; per branch
    ``encoder_hidden_states`` (N, L_text, D_text) with L_text the text's own length, and
    ``img_shapes`` (a list of N ``[(1, H/16, W/16)]`` entries). True-CFG branches:
    [negative, positive].
    """

    pipeline_class_name = "QwenImagePipeline"
    pipeline_class: type = QwenImagePipeline
    # diffusers' QwenImagePipeline.__call__ defaults
    sampling_defaults = {"num_inference_steps": 50, "true_cfg_scale": 4.0, "max_sequence_length": 512}
    guidance = TRUE_CFG_NORM_RESCALED
    #: text embeddings are right-padded with zeros; the mask marks the real tokens
    padded_inputs = {"encoder_hidden_states": ("encoder_hidden_states_mask", 0.0)}
    per_request_samplers = True
    mixed_sizes = True

    def setup(self) -> dict[str, Any]:
        """Refuses guidance-distilled transformers; text encoding; TeaCache (plain time
        embeddings only), cache-dit and regional compile."""
        pipe = self.pipe
        transformer = pipe.transformer.config
        if transformer.get("guidance_embeds"):
            raise UnsupportedModelError(
                f"{self.pipeline_class_name} with a guidance-distilled transformer (guidance_embeds=true) is not "
                "supported: diffusers 0.42.1's QwenImageTransformer2DModel cannot take the guidance input")
        self.text = self.make_text_encoder()
        plain_time_embedding = not (transformer.get("zero_cond_t") or transformer.get("use_additional_t_cond"))
        self.capabilities = Capabilities(
            teacache=TEACACHE if plain_time_embedding else None,
            # QwenImageTransformerBlock takes (hidden_states, encoder_hidden_states) and returns
            # (encoder_hidden_states, hidden_states): cache-dit 1.5.3's own QwenImage adapter uses
            # ForwardPattern.Pattern_1; every block returns the encoder stream.
            cache_dit=CacheDiTSupport(blocks=("transformer_blocks",), patterns=("Pattern_1",),
                                      has_encoder_residual=True),
            repeated_blocks=("QwenImageTransformerBlock",),
        )
        self.mixed_sizes = self.mixed_sizes and install_token_spans(pipe.transformer, grouped=self.grouping)
        factor = pipe.vae_scale_factor * 2
        # RoPE rows: text positions start after max(h, w) / 2 of the latent grid (scale_rope)
        max_side = (pipe.transformer.pos_embed.pos_freqs.shape[0] - MAX_SEQUENCE_LENGTH_LIMIT) * 2 * factor
        return {"resolution_factor": factor, "max_sequence_length_limit": MAX_SEQUENCE_LENGTH_LIMIT,
                "max_prompt_tokens": pipe.tokenizer_max_length, "max_height": max_side, "max_width": max_side}

    def make_text_encoder(self) -> TextEncoder:
        """The cached text encoding (the request's max_sequence_length bounds the tokens)."""
        return TextEncoder(self, self._encode_text, [(self.pipe.tokenizer, None)])

    def prompt_is_truncated(self, prompt: str, max_sequence_length: int | None = None) -> bool:
        """Whether the prompt's tokens after the template prefix exceed max_sequence_length
        (diffusers cuts the encoding there, and the templated text at 1024 + prefix tokens)."""
        cut = self.text.cut(prompt, max_sequence_length)
        if len(cut) < len(prompt):
            return True
        pipe = self.pipe
        ids = pipe.tokenizer(pipe.prompt_template_encode.format(cut)).input_ids
        kept = min(max_sequence_length or pipe.tokenizer_max_length, pipe.tokenizer_max_length)
        return len(ids) - pipe.prompt_template_encode_start_idx > kept

    def _encode_text(self, text: str, max_sequence_length: int | None):
        """diffusers' encoding of one text: prompt_embeds (1, L_text, D_text) (no mask: one
        text has no padding)."""
        embeds, _ = self.pipe.encode_prompt(prompt=text, device=self.device, num_images_per_prompt=1,
                                            max_sequence_length=max_sequence_length)
        return (embeds,)

    def prepare_request(self, state: RequestState) -> None:
        """Encode the texts through the cache, draw packed latents exactly as diffusers does,
        and create the request's own scheduler with diffusers' sigmas and dynamic shift."""
        p, pipe = state.params, self.pipe
        n = p.num_images_per_prompt
        shapes = [(1, p.height // pipe.vae_scale_factor // 2, p.width // pipe.vae_scale_factor // 2)]
        state.branches = [{**branch, "img_shapes": [shapes] * n} for branch in self.text_branches(state)]
        state.latents = pipe.prepare_latents(n, pipe.transformer.config.in_channels // 4, p.height, p.width,
                                             state.branches[-1]["encoder_hidden_states"].dtype, self.device,
                                             state.generator)
        self.set_timesteps(state, image_seq_len=state.latents.shape[1])
        set_token_span(state, shapes[0], self.mixed_sizes)

    def timestep_arguments(self, scheduler: Any, num_steps: int) -> dict[str, Any]:
        """The linear ``sigmas`` and ``mu`` (as diffusers' Qwen-Image ``__call__``)."""
        return {"sigmas": np.linspace(1.0, 1 / num_steps, num_steps), "mu": 1.0}

    def set_timesteps(self, state: RequestState, image_seq_len: int) -> None:
        """The request's own scheduler (`request_scheduler`) with diffusers' schedule: ``sigmas
        = linspace(1, 1/N, N)`` shifted by ``mu = calculate_shift(image_seq_len, ...)`` from the
        scheduler config."""
        steps = state.params.num_inference_steps
        scheduler = self.request_scheduler(state.params)
        cfg = scheduler.config
        mu = calculate_shift(image_seq_len, cfg.get("base_image_seq_len", 256), cfg.get("max_image_seq_len", 4096),
                             cfg.get("base_shift", 0.5), cfg.get("max_shift", 1.15))
        timesteps, _ = retrieve_timesteps(scheduler, steps, self.device,
                                          sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
        scheduler.set_begin_index(0)
        self.set_schedule(state, scheduler, timesteps)

    def forward_inputs(self, batch: StepBatch) -> dict[str, Any]:
        """The transformer's arguments, with ``timestep / 1000``; rows of different sizes with
        their token spans (`qwen_image.mixed_sizes.span_inputs`)."""
        x = batch.inputs
        hidden = x["hidden_states"]
        return span_inputs(batch, {"hidden_states": hidden, "timestep": x["timestep"].to(hidden.dtype) / 1000,
                                   "encoder_hidden_states": x["encoder_hidden_states"],
                                   "encoder_hidden_states_mask": x.get("encoder_hidden_states_mask"),
                                   "img_shapes": x["img_shapes"]})

    def decode(self, state: RequestState, latents: torch.Tensor | None = None) -> Any:
        """Unpack to (N, C, 1, H/8, W/8), undo the latent normalisation (``x * std + mean``),
        VAE-decode the single frame and post-process to the request's output_type
        ("latent" returns the packed latents, as diffusers does)."""
        latents = state.latents if latents is None else latents
        p = state.params
        if p.output_type == "latent":
            return latents
        pipe = self.pipe
        vae = pipe.vae
        # a mixed batch's rows are views of its padded latents: unpacking needs them contiguous
        latents = pipe._unpack_latents(latents.contiguous(), p.height, p.width, pipe.vae_scale_factor).to(vae.dtype)
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents.device, latents.dtype)
        inverse_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(latents.device, latents.dtype)
        image = vae.decode(latents / inverse_std + mean, return_dict=False)[0][:, :, 0]
        return pipe.image_processor.postprocess(checked_pixels(image), output_type=p.output_type)
