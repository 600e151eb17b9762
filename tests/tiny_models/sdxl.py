"""Tiny random-weight ``StableDiffusionXLPipeline`` in the SDXL base 1.0 layout.

Components: ``UNet2DConditionModel`` with the ``text_time`` addition embedding
(``addition_time_embed_dim=8``, ``projection_class_embeddings_input_dim`` = 32 + 6 x 8 = 80:
text_encoder_2's projection width plus six time ids), cross-attention width 64 = 32 (CLIP-L-like
``CLIPTextModel``) + 32 (CLIP-G-like ``CLIPTextModelWithProjection``, projection 32), two
``CLIPTokenizer`` (77 tokens), ``AutoencoderKL`` with 4 latent channels, the real 8x
down-sampling and SDXL's ``scaling_factor=0.13025``, and SDXL base's ``EulerDiscreteScheduler``
config (``timestep_spacing="leading"``, ``steps_offset=1``, scaled-linear betas 0.00085..0.012).
``force_zeros_for_empty_prompt=True`` as in the real ``model_index.json``; no watermarker.
Default size = ``unet.config.sample_size`` (8) x 8 = 64 pixels.

Parity notes: diffusers 0.42.1, ``pipelines/stable_diffusion_xl/pipeline_stable_diffusion_xl.py``
-------------------------------------------------------------------------------------------------
* Defaults (``StableDiffusionXLPipeline.__call__``): ``num_inference_steps=50``,
  ``guidance_scale=5.0``, ``negative_prompt=None``, ``guidance_rescale=0.0``,
  ``denoising_end=None``, ``original_size``/``target_size`` = ``(height, width)``,
  ``crops_coords_top_left=(0, 0)``, ``negative_original_size``/``negative_target_size`` None,
  ``eta=0.0``, ``clip_skip=None``. ``height``/``width`` default to ``default_sample_size *
  vae_scale_factor`` with ``default_sample_size = unet.config.sample_size`` (real: 128 * 8 = 1024);
  multiples of 8 required (``check_inputs`` raises). No ``max_sequence_length`` (77 per tokenizer).
* Text (``encode_prompt``): for (tokenizer, text_encoder) and (tokenizer_2, text_encoder_2), pad to
  ``model_max_length``, call with ``output_hidden_states=True`` and take ``hidden_states[-2]``
  (penultimate layer, no final layer norm; ``clip_skip=k`` -> ``hidden_states[-(k + 2)]``);
  concatenate the two on the last dim -> ``prompt_embeds`` (B, 77, 768 + 1280 real). Pooled =
  ``text_embeds`` of ``text_encoder_2`` (its output ``[0]`` is 2-D). ``prompt_2`` defaults to
  ``prompt``. (The real tokenizer_2 pads with ``"!"``, tokenizer with ``<|endoftext|>``.)
* Negative: if ``negative_prompt is None`` and the pipeline config's
  ``force_zeros_for_empty_prompt`` -> ``zeros_like`` for both negative embeddings and negative
  pooled; otherwise ``negative_prompt or ""`` encoded the same way.
* Added conditions (``_get_add_time_ids``): ``time_ids = [orig_h, orig_w, crop_top, crop_left,
  target_h, target_w]`` (float, (B, 6)); negative time ids = the same unless
  ``negative_original_size`` and ``negative_target_size`` are given. ``added_cond_kwargs =
  {"text_embeds": pooled (B, proj), "time_ids": (B, 6)}``; it raises if
  ``addition_time_embed_dim * 6 + text_encoder_2.config.projection_dim`` differs from
  ``unet.add_embedding.linear_1.in_features``.
* CFG: ``guidance_scale > 1 and unet.config.time_cond_proj_dim is None``; one UNet call on
  ``torch.cat([latents] * 2)`` with ``[negative, positive]`` concatenated for ``prompt_embeds``,
  ``text_embeds`` and ``time_ids`` (uncond rows first); ``uncond + g * (text - uncond)``; optional
  ``rescale_noise_cfg`` when ``guidance_rescale > 0``.
* Timesteps: ``retrieve_timesteps(scheduler, N)``; leading spacing with ``steps_offset=1``:
  ``(arange(N) * (1000 // N)).round()[::-1] + 1`` (50 steps: 981, 961, ..., 1); UNet gets ``t``
  (float) and ``scheduler.scale_model_input(x, t)`` = ``x / sqrt(sigma^2 + 1)``; initial latents
  ``randn_tensor((B, 4, H/8, W/8), generator) * init_noise_sigma`` (leading spacing:
  ``sqrt(sigma_max^2 + 1)``). ``set_begin_index(0)``. ``denoising_end=f`` keeps the timesteps
  ``>= round(1000 - f * 1000)``.
* Step: ``scheduler.step(noise, t, latents, **extra_step_kwargs)`` (``generator`` / ``eta`` if
  accepted, as in SD 1.5).
* Decode: if the VAE config has ``latents_mean`` and ``latents_std`` (SDXL base: no),
  ``latents * std / scaling_factor + mean``, else ``latents / scaling_factor``; fp16 VAEs with
  ``force_upcast`` are upcast to fp32; ``vae.decode``; watermark if ``invisible-watermark`` is
  installed (``add_watermarker=None`` -> installed?) -- it changes pixels; ``postprocess``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel

from .components import autoencoder_kl, clip_text_model, clip_text_model_with_projection, clip_tokenizer

#: ``scheduler/scheduler_config.json`` of stabilityai/stable-diffusion-xl-base-1.0.
SDXL_SCHEDULER = dict(
    beta_start=0.00085,
    beta_end=0.012,
    beta_schedule="scaled_linear",
    num_train_timesteps=1000,
    prediction_type="epsilon",
    interpolation_type="linear",
    timestep_spacing="leading",
    steps_offset=1,
    use_karras_sigmas=False,
    trained_betas=None,
)

ADDITION_TIME_EMBED_DIM = 8
TEXT_ENCODER_2_PROJECTION_DIM = 32


def build_tiny_sdxl(out: Path, *, seed: int = 0) -> Path:
    """Build a tiny random-weight ``StableDiffusionXLPipeline`` (SDXL base layout) into ``out``.

    Args:
        out: folder to write (created if missing).
        seed: ``torch.manual_seed`` for the random weights.

    Returns:
        ``out`` as a ``Path`` (~1 MB). Sizes must be multiples of 8 pixels; default 64x64.
    """
    torch.manual_seed(seed)
    unet = UNet2DConditionModel(
        sample_size=8,  # default size 8 * 8 = 64 px (real SDXL: 128 -> 1024 px)
        in_channels=4,
        out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        block_out_channels=(8, 16),
        layers_per_block=1,
        attention_head_dim=(2, 4),
        use_linear_projection=True,
        transformer_layers_per_block=(1, 2),
        cross_attention_dim=64,  # 32 (text_encoder) + 32 (text_encoder_2), concatenated
        addition_embed_type="text_time",
        addition_time_embed_dim=ADDITION_TIME_EMBED_DIM,
        projection_class_embeddings_input_dim=TEXT_ENCODER_2_PROJECTION_DIM + 6 * ADDITION_TIME_EMBED_DIM,
        norm_num_groups=4,
    )
    tokenizer = clip_tokenizer(77)
    tokenizer_2 = clip_tokenizer(77)
    pipe = StableDiffusionXLPipeline(
        vae=autoencoder_kl(latent_channels=4, scaling_factor=0.13025),
        text_encoder=clip_text_model(tokenizer, hidden_size=32),
        text_encoder_2=clip_text_model_with_projection(
            tokenizer_2, hidden_size=32, projection_dim=TEXT_ENCODER_2_PROJECTION_DIM
        ),
        tokenizer=tokenizer,
        tokenizer_2=tokenizer_2,
        unet=unet,
        scheduler=EulerDiscreteScheduler(**SDXL_SCHEDULER),
        force_zeros_for_empty_prompt=True,
        add_watermarker=False,
    )
    out = Path(out)
    pipe.save_pretrained(out)
    return out
