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
  ``encoder_hidden_states_mask`` (`pad_keys`). The transformer masks padded keys in its joint
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
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch
from diffusers import QwenImagePipeline
from diffusers.models.transformers.transformer_qwenimage import compute_text_seq_len_from_mask
from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift, retrieve_timesteps

from diffserve.core.errors import InvalidRequestError, UnsupportedModelError
from diffserve.pipelines import guidance
from diffserve.pipelines.base import (
    AdapterOptions,
    CacheDiTSupport,
    Capabilities,
    PipelineAdapter,
    RequestInputs,
    RequestState,
    StepBatch,
    TeaCacheSupport,
    checked_pixels,
)
from diffserve.pipelines.diffusion_scheduler import batchable_sigmas, new_scheduler
from diffserve.pipelines.generation_config import read_generation_config
from diffserve.pipelines.text_encoding import TextEncoder, repeat_rows
from diffserve.core.sampling_params import ModelSpec, SamplingParams

# diffserve decides guidance itself; diffusers warns on every call with true_cfg_scale > 1 and no
# negative prompt (its default).
logging.getLogger("diffusers.pipelines.qwenimage").setLevel(logging.ERROR)

# diffusers' QwenImagePipeline.__call__ defaults.
DEFAULT_NUM_INFERENCE_STEPS = 50
DEFAULT_TRUE_CFG_SCALE = 4.0
DEFAULT_MAX_SEQUENCE_LENGTH = 512
#: diffusers' check_inputs refuses more (the pipeline's tokenizer_max_length).
MAX_SEQUENCE_LENGTH_LIMIT = 1024

#: Qwen-Image TeaCache rescaling coefficients as vLLM-Omni ships them for
#: QwenImageTransformer2DModel ("from ComfyUI-TeaCache"; vllm_omni/diffusion/cache/teacache/config.py).
QWEN_TEACACHE_COEFFICIENTS = (-4.5e02, 2.8e02, -4.5e01, 3.2e00, -2.0e-02)


class QwenImageTeaCacheSplit:
    """`QwenImageTransformer2DModel.forward` (diffusers 0.42.1) in three parts around the blocks,
    for TeaCache; transformers without ``zero_cond_t`` / ``use_additional_t_cond`` and without
    ControlNet residuals.

    Tensors: hidden (rows, N_img, D); context = dict(encoder (rows, N_txt, D), mask (rows, N_txt)
    bool or None, temb (rows, D), rotary (image and text RoPE, shared by the rows),
    attention_kwargs); output (rows, N_img, patch**2 * C_out) packed.
    """

    @staticmethod
    def embed(model, kwargs: dict[str, Any]):
        """Returns (hidden, context, modulated input of the first block's image stream)."""
        hidden = model.img_in(kwargs["hidden_states"])
        timestep = kwargs["timestep"].to(hidden.dtype)
        encoder = model.txt_in(model.txt_norm(kwargs["encoder_hidden_states"]))
        text_len, _, mask = compute_text_seq_len_from_mask(encoder, kwargs.get("encoder_hidden_states_mask"))
        temb = model.time_text_embed(timestep, hidden)
        rotary = model.pos_embed(kwargs["img_shapes"], max_txt_seq_len=text_len, device=hidden.device)
        first = model.transformer_blocks[0]
        img_mod1 = first.img_mod(temb).chunk(2, dim=-1)[0]
        modulated = first._modulate(first.img_norm1(hidden), img_mod1)[0]
        context = {"encoder": encoder, "mask": mask, "temb": temb, "rotary": rotary,
                   "attention_kwargs": kwargs.get("attention_kwargs")}
        return hidden, context, modulated

    @staticmethod
    def select_rows(context: dict[str, Any], index: torch.Tensor) -> dict[str, Any]:
        mask = context["mask"]
        return {**context, "encoder": context["encoder"][index], "temb": context["temb"][index],
                "mask": None if mask is None else mask[index]}

    @staticmethod
    def blocks(model, hidden: torch.Tensor, context: dict[str, Any]) -> torch.Tensor:
        """Every transformer block; returns the image stream (rows, N_img, D)."""
        encoder = context["encoder"]
        for block in model.transformer_blocks:
            encoder, hidden = block(hidden_states=hidden, encoder_hidden_states=encoder,
                                    encoder_hidden_states_mask=context["mask"], temb=context["temb"],
                                    image_rotary_emb=context["rotary"],
                                    joint_attention_kwargs=context["attention_kwargs"])
        return hidden

    @staticmethod
    def head(model, hidden: torch.Tensor, context: dict[str, Any]) -> torch.Tensor:
        """norm_out and proj_out: (rows, N_img, patch**2 * C_out)."""
        return model.proj_out(model.norm_out(hidden, context["temb"]))


class QwenImageAdapter(PipelineAdapter):
    """Step-contract adapter over a diffusers `QwenImagePipeline`.

    Tensors: latents (N, (H/16)*(W/16), 4*C_latent) packed, in the model dtype; per branch
    ``encoder_hidden_states`` (N, L_text, D_text) with L_text the text's own length, and
    ``img_shapes`` (a list of N ``[(1, H/16, W/16)]`` entries). True-CFG branches:
    [negative, positive].
    """

    pipeline_class_name = "QwenImagePipeline"
    pipeline_class: type = QwenImagePipeline

    def __init__(self, pipe: Any, device: torch.device, dtype: torch.dtype, options: AdapterOptions):
        self.pipe = pipe
        self.device = device
        self.dtype = dtype
        transformer = pipe.transformer.config
        if transformer.get("guidance_embeds"):
            raise UnsupportedModelError(
                f"{self.pipeline_class_name} with a guidance-distilled transformer (guidance_embeds=true) is not "
                "supported: diffusers 0.42.1's QwenImageTransformer2DModel cannot take the guidance input")
        config = read_generation_config(options.model_dir)
        factor = pipe.vae_scale_factor * 2
        rope_positions = pipe.transformer.pos_embed.pos_freqs.shape[0]
        #: RoPE rows: text positions start after max(h, w) / 2 of the latent grid (scale_rope).
        max_side = (rope_positions - MAX_SEQUENCE_LENGTH_LIMIT) * 2 * factor
        default_side = pipe.default_sample_size * pipe.vae_scale_factor
        fields = dict(
            pipeline=self.pipeline_class_name,
            resolution_factor=factor,
            default_height=int(config.get("height", default_side)),
            default_width=int(config.get("width", default_side)),
            default_num_inference_steps=int(config.get("num_inference_steps", DEFAULT_NUM_INFERENCE_STEPS)),
            default_guidance_scale=None,
            default_true_cfg_scale=float(config.get("true_cfg_scale", DEFAULT_TRUE_CFG_SCALE)),
            default_max_sequence_length=int(config.get("max_sequence_length", DEFAULT_MAX_SEQUENCE_LENGTH)),
            max_sequence_length_limit=MAX_SEQUENCE_LENGTH_LIMIT,
            text_conditioned=True,
            max_prompt_tokens=pipe.tokenizer_max_length,
            max_height=max_side,
            max_width=max_side,
        )
        self.spec = ModelSpec(**{**fields, **self.extra_spec(config)})
        teacache = config.get("teacache", {})
        plain_time_embedding = not (transformer.get("zero_cond_t") or transformer.get("use_additional_t_cond"))
        self.capabilities = Capabilities(
            teacache=TeaCacheSupport(
                split=QwenImageTeaCacheSplit,
                coefficients=tuple(teacache.get("coefficients", QWEN_TEACACHE_COEFFICIENTS)),
                rel_l1_thresh=float(teacache.get("rel_l1_thresh", 0.2)),
                source=teacache.get("source", "vLLM-Omni's QwenImageTransformer2DModel coefficients (from "
                                              "ComfyUI-TeaCache); 0.2 ~1.5x per vLLM-Omni's TeaCache guide"),
            ) if plain_time_embedding else None,
            # QwenImageTransformerBlock takes (hidden_states, encoder_hidden_states) and returns
            # (encoder_hidden_states, hidden_states): cache-dit 1.5.3's own QwenImage adapter uses
            # ForwardPattern.Pattern_1; every block returns the encoder stream.
            cache_dit=CacheDiTSupport(blocks=("transformer_blocks",), patterns=("Pattern_1",),
                                      has_encoder_residual=True),
            repeated_blocks=("QwenImageTransformerBlock",),
        )
        self.text = self.make_text_encoder()

    def extra_spec(self, config: dict[str, Any]) -> dict[str, Any]:
        """`ModelSpec` fields a subclass sets differently (edit: image inputs, no text budget)."""
        return {}

    def make_text_encoder(self) -> TextEncoder:
        """The cached text encoding (the request's max_sequence_length bounds the tokens)."""
        return TextEncoder(self, self._encode_text, [(self.pipe.tokenizer, None)])

    @classmethod
    def from_components(cls, components, device, dtype, options):
        pipe = cls.pipeline_class(**components)
        pipe.to(device, silence_dtype_warnings=True)
        pipe.set_progress_bar_config(disable=True)
        return cls(pipe, device, dtype, options)

    @property
    def denoiser(self) -> torch.nn.Module:
        return self.pipe.transformer

    # --------------------------------------------------------------- per request
    def check_params(self, params: SamplingParams, inputs: RequestInputs | None) -> None:
        """No image inputs, and `check_schedule`."""
        super().check_params(params, inputs)
        self.check_schedule(params)

    def check_schedule(self, params: SamplingParams) -> None:
        """Refuse 1 step when the scheduler stretches its sigmas to a terminal value
        (``shift_terminal``, as in Qwen-Image's folders): a 1-sigma schedule stretches to
        0/0 = NaN in diffusers."""
        if params.num_inference_steps == 1 and self.pipe.scheduler.config.get("shift_terminal"):
            raise InvalidRequestError("num_inference_steps", 1,
                                      "at least 2 for this model (its scheduler's shift_terminal turns a "
                                      "1-step schedule into NaN in diffusers)")

    def branches(self, params: SamplingParams) -> int:
        """2 (negative, positive) with true CFG: ``true_cfg_scale > 1`` and a negative prompt
        given (even ``""``), as diffusers decides; else 1."""
        return 2 if params.true_cfg_scale > 1.0 and params.negative_prompt is not None else 1

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

    def texts(self, state: RequestState) -> list[str]:
        """The texts of the request's branches, negative first."""
        p = state.params
        return [p.negative_prompt, state.prompt] if self.branches(p) == 2 else [state.prompt]

    def prepare_request(self, state: RequestState) -> None:
        """Encode the texts through the cache, draw packed latents exactly as diffusers does,
        and create the request's own scheduler with diffusers' sigmas and dynamic shift."""
        p = state.params
        n = p.num_images_per_prompt
        pipe = self.pipe
        shapes = [(1, p.height // pipe.vae_scale_factor // 2, p.width // pipe.vae_scale_factor // 2)]
        state.branches = []
        for text in self.texts(state):
            (embeds,) = self.text.encode(text, p.max_sequence_length)
            state.branches.append({"encoder_hidden_states": repeat_rows(embeds, n), "img_shapes": [shapes] * n})
        state.latents = pipe.prepare_latents(n, pipe.transformer.config.in_channels // 4, p.height, p.width,
                                             embeds.dtype, self.device, state.generator)
        state.guidance_scale = p.true_cfg_scale
        self.set_timesteps(state, image_seq_len=state.latents.shape[1])

    def set_timesteps(self, state: RequestState, image_seq_len: int) -> None:
        """The request's own scheduler with diffusers' schedule: ``sigmas = linspace(1, 1/N, N)``
        shifted by ``mu = calculate_shift(image_seq_len, ...)`` from the scheduler config."""
        steps = state.params.num_inference_steps
        scheduler = new_scheduler(self.pipe.scheduler)
        cfg = scheduler.config
        mu = calculate_shift(image_seq_len, cfg.get("base_image_seq_len", 256), cfg.get("max_image_seq_len", 4096),
                             cfg.get("base_shift", 0.5), cfg.get("max_shift", 1.15))
        timesteps, _ = retrieve_timesteps(scheduler, steps, self.device,
                                          sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
        scheduler.set_begin_index(0)
        state.scheduler = scheduler
        state.timesteps = timesteps
        state.sigmas = batchable_sigmas(scheduler, len(timesteps))

    # ------------------------------------------------------------------ per step
    def pad_keys(self) -> dict[str, tuple[str | None, float]]:
        """Text embeddings are right-padded with zeros; ``encoder_hidden_states_mask`` marks
        the real tokens (None when no row is padded)."""
        return {"encoder_hidden_states": ("encoder_hidden_states_mask", 0.0)}

    def denoise_kwargs(self, batch: StepBatch) -> dict[str, Any]:
        x = batch.inputs
        hidden = x["hidden_states"]
        return {"hidden_states": hidden, "timestep": x["timestep"].to(hidden.dtype) / 1000,
                "encoder_hidden_states": x["encoder_hidden_states"],
                "encoder_hidden_states_mask": x.get("encoder_hidden_states_mask"),
                "img_shapes": x["img_shapes"]}

    def combine(self, batch: StepBatch, out: torch.Tensor) -> torch.Tensor:
        """True CFG rescaled per token to the conditional prediction's norm (diffusers'
        `QwenImagePipeline`)."""
        if batch.branches == 1:
            return out
        uncond, cond = out.chunk(2)
        scale = guidance.uniform_or_rows([s.guidance_scale for s in batch.states], batch.row_values)
        return guidance.cfg_norm_rescaled(uncond, cond, scale)

    # ------------------------------------------------------------------ decode
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
        latents = pipe._unpack_latents(latents, p.height, p.width, pipe.vae_scale_factor).to(vae.dtype)
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents.device, latents.dtype)
        inverse_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(latents.device, latents.dtype)
        image = vae.decode(latents / inverse_std + mean, return_dict=False)[0][:, :, 0]
        return pipe.image_processor.postprocess(checked_pixels(image), output_type=p.output_type)
