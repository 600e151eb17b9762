"""Tiny random-weight ``StableDiffusionPipeline`` in the SD 1.5 layout, with a selectable scheduler.

Components: ``UNet2DConditionModel`` (2 blocks, cross-attention width 32), ``CLIPTextModel`` +
``CLIPTokenizer`` (77 tokens), ``AutoencoderKL`` with 4 latent channels, the real 8x
down-sampling and SD 1.5's ``scaling_factor=0.18215``; no safety checker
(``requires_safety_checker=False``). The scheduler is SD 1.5's ``PNDMScheduler`` config
(``scheduler/scheduler_config.json`` of stable-diffusion-v1-5: ``beta_start=0.00085``,
``beta_end=0.012``, ``beta_schedule="scaled_linear"``, ``skip_prk_steps=True``,
``steps_offset=1``, ``set_alpha_to_one=False``, ``clip_sample=False``) or another class made from
it with ``Class.from_config(pndm.config)`` (the usual scheduler swap), with ``prediction_type``
``"epsilon"`` (SD 1.x) or ``"v_prediction"`` (SD 2.x-v). Default size = ``unet.config.sample_size``
(8) x 8 = 64 pixels.

Parity notes: diffusers 0.42.1, ``pipelines/stable_diffusion/pipeline_stable_diffusion.py``
-------------------------------------------------------------------------------------------
* Defaults (``StableDiffusionPipeline.__call__``): ``num_inference_steps=50``,
  ``guidance_scale=7.5``, ``negative_prompt=None``, ``eta=0.0``, ``guidance_rescale=0.0``,
  ``clip_skip=None``; ``height``/``width`` default to ``unet.config.sample_size *
  vae_scale_factor`` (real SD 1.5: 64 * 8 = 512); ``check_inputs`` raises unless both are
  multiples of 8. No ``max_sequence_length``: prompts are padded/truncated to the tokenizer's
  ``model_max_length`` (77).
* ``__init__`` rewrites the scheduler config when ``steps_offset != 1`` or ``clip_sample`` is True
  (deprecation fix-ups): adapters loading the scheduler themselves must apply the same.
* Text (``encode_prompt``): ``text_encoder(ids)[0]`` = last hidden state after the final layer
  norm (``clip_skip=k`` takes ``hidden_states[-(k + 1)]`` then ``final_layer_norm``); an attention
  mask is passed only if ``text_encoder.config.use_attention_mask``. CFG negative:
  ``negative_prompt`` or ``""``, padded to the same length.
* CFG: ``do_classifier_free_guidance = guidance_scale > 1 and unet.config.time_cond_proj_dim is
  None``; one UNet call on ``torch.cat([latents] * 2)`` with ``torch.cat([negative, positive])``
  embeddings (uncond rows first); ``uncond, text = noise.chunk(2)``;
  ``noise = uncond + guidance_scale * (text - uncond)``; then, if ``guidance_rescale > 0``,
  ``rescale_noise_cfg`` (std ratio, arXiv:2305.08891 sec. 3.4).
* Timesteps: ``retrieve_timesteps(scheduler, N)`` -> ``scheduler.set_timesteps(N)``; the UNet
  gets ``t`` itself (integer-valued: int64 for PNDM/DDIM/DPM-Solver, float for Euler), and its
  input goes through ``scheduler.scale_model_input(x, t)`` (identity except Euler-type:
  ``x / sqrt(sigma^2 + 1)``). Initial latents ``randn_tensor((B, 4, H/8, W/8), generator) *
  scheduler.init_noise_sigma``.
* Swapped schedulers (``Class.from_config(pndm.config)``) keep only the keys the SD 1.5 file sets;
  the others take the class defaults, e.g. ``timestep_spacing``: PNDM/DDIM ``"leading"`` (+
  ``steps_offset=1``), Euler/Euler-ancestral/DPM-Solver ``"linspace"``. 2 steps give the timesteps
  PNDM [501, 1, 1], DDIM [501, 1], Euler [999.0, 0.0], DPM-Solver++ [999, 500].
* PNDM with ``skip_prk_steps``: N steps give N + 1 timesteps (the second one is repeated for the
  PLMS warm-up), so the UNet runs N + 1 times; ``step`` keeps ``ets``/``counter`` history.
  DPM-Solver++ multistep keeps ``model_outputs``/``lower_order_nums``; Euler keeps
  ``_step_index``. All are per-request state.
* Step: ``scheduler.step(noise, t, latents, **extra_step_kwargs)`` where ``eta`` and
  ``generator`` are passed if the scheduler's ``step`` accepts them
  (``prepare_extra_step_kwargs``): Euler-ancestral draws noise from the request's generator every
  step, and DDIM does when ``eta > 0``.
* Decode: ``vae.decode(latents / vae.config.scaling_factor, generator=generator)``, safety checker
  (none here), ``image_processor.postprocess`` (``(x / 2 + 0.5).clamp(0, 1)``).
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import (
    DDIMScheduler,
    DPMSolverMultistepScheduler,
    EulerAncestralDiscreteScheduler,
    EulerDiscreteScheduler,
    PNDMScheduler,
    StableDiffusionPipeline,
    UNet2DConditionModel,
)

from .components import autoencoder_kl, clip_text_model, clip_tokenizer

#: ``scheduler/scheduler_config.json`` of stable-diffusion-v1-5 (PNDM).
SD15_SCHEDULER = dict(
    beta_start=0.00085,
    beta_end=0.012,
    beta_schedule="scaled_linear",
    num_train_timesteps=1000,
    set_alpha_to_one=False,
    skip_prk_steps=True,
    steps_offset=1,
    trained_betas=None,
    clip_sample=False,  # not a PNDM argument: kept in the config, read by DDIM after a swap
)

#: Scheduler classes the builder can write; the key is the diffusers class name.
SCHEDULERS = {
    cls.__name__: cls
    for cls in (
        PNDMScheduler,
        EulerDiscreteScheduler,
        EulerAncestralDiscreteScheduler,
        DDIMScheduler,
        DPMSolverMultistepScheduler,
    )
}


def build_tiny_sd15(
    out: Path,
    *,
    scheduler: str = "PNDMScheduler",
    prediction_type: str = "epsilon",
    seed: int = 0,
) -> Path:
    """Build a tiny random-weight ``StableDiffusionPipeline`` (SD 1.5 layout) into ``out``.

    Args:
        out: folder to write (created if missing).
        scheduler: diffusers class name, one of :data:`SCHEDULERS` (``"PNDMScheduler"`` as in the
            real SD 1.5 folder; the others are ``Class.from_config(pndm.config)``).
        prediction_type: ``"epsilon"`` or ``"v_prediction"``.
        seed: ``torch.manual_seed`` for the random weights.

    Returns:
        ``out`` as a ``Path`` (~1 MB). Sizes must be multiples of 8 pixels; default 64x64.

    Raises:
        ValueError: unknown ``scheduler`` or ``prediction_type``.
    """
    if scheduler not in SCHEDULERS:
        raise ValueError(f"scheduler must be one of {sorted(SCHEDULERS)}, got {scheduler!r}")
    if prediction_type not in ("epsilon", "v_prediction"):
        raise ValueError(f"prediction_type must be 'epsilon' or 'v_prediction', got {prediction_type!r}")
    torch.manual_seed(seed)
    unet = UNet2DConditionModel(
        sample_size=8,  # default size 8 * 8 = 64 px (real SD 1.5: 64 -> 512 px)
        in_channels=4,
        out_channels=4,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        block_out_channels=(8, 16),
        layers_per_block=1,
        attention_head_dim=2,
        cross_attention_dim=32,  # = CLIP hidden size
        norm_num_groups=4,
    )
    tokenizer = clip_tokenizer(77)
    pndm = PNDMScheduler.from_config({**SD15_SCHEDULER, "prediction_type": prediction_type})
    pipe = StableDiffusionPipeline(
        vae=autoencoder_kl(latent_channels=4, scaling_factor=0.18215),
        text_encoder=clip_text_model(tokenizer, hidden_size=32),
        tokenizer=tokenizer,
        unet=unet,
        scheduler=pndm if scheduler == "PNDMScheduler" else SCHEDULERS[scheduler].from_config(pndm.config),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    out = Path(out)
    pipe.save_pretrained(out)
    return out
