"""Tiny random-weight ``FluxPipeline`` (FLUX.1 schnell/dev layouts) and ``FluxKontextPipeline``.

Components: ``FluxTransformer2DModel`` (MMDiT, 2-D RoPE over ``(id, row, col)`` ids),
``CLIPTextModel`` (pooled only) + ``CLIPTokenizer`` (77 tokens), ``T5EncoderModel`` +
``T5Tokenizer``, ``AutoencoderKL`` with 16 latent channels and the real 8x down-sampling
(FLUX.1's ``scaling_factor=0.3611``, ``shift_factor=0.1159``, no quant convs), and
``FlowMatchEulerDiscreteScheduler`` with the real folders' settings: schnell ``shift=1.0`` without
dynamic shifting, dev/Kontext dynamic shifting (``base_image_seq_len=256``,
``max_image_seq_len=4096``, ``base_shift=0.5``, ``max_shift=1.15``, ``shift=3.0``).
Resolution factor 16 pixels (VAE 8 x 2x2 packing).

Parity notes: diffusers 0.42.1, ``pipelines/flux/pipeline_flux.py`` (``FluxPipeline.__call__``)
--------------------------------------------------------------------------------------------
* Defaults: ``num_inference_steps=28``, ``guidance_scale=3.5``, ``true_cfg_scale=1.0``,
  ``negative_prompt=None``, ``max_sequence_length=512`` (``check_inputs`` raises above 512),
  ``output_type="pil"``. ``height``/``width`` default to ``default_sample_size * vae_scale_factor``
  = 128 * 8 = 1024 whatever the folder's configs say (``default_sample_size`` is a constant).
  A size that is not a multiple of 16 only logs a warning; ``prepare_latents`` floors it to
  ``2 * (size // 16)`` latent pixels and the decoded image has the floored size.
* Text (``encode_prompt``): ``_get_clip_prompt_embeds`` pads/truncates to the CLIP tokenizer's
  ``model_max_length`` (77) and keeps only ``pooler_output`` -> ``pooled_projections`` (B, 768 real);
  ``_get_t5_prompt_embeds`` pads to ``max_sequence_length`` (``padding="max_length"``, no mask)
  -> ``encoder_hidden_states`` (B, max_sequence_length, 4096 real). ``prompt_2`` defaults to
  ``prompt``. ``text_ids = zeros(seq_len, 3)``.
* Latents (``prepare_latents``): ``randn_tensor((B, in_channels // 4, 2*(H//16), 2*(W//16)),
  generator)``, then ``_pack_latents`` -> (B, (h/2)*(w/2), in_channels): each 2x2 latent patch
  becomes one token, channel order (c, dy, dx). ``_prepare_latent_image_ids`` -> (h/2*w/2, 3) with
  ``[0, row, col]``. ``img_ids``/``txt_ids`` are 2-D (no batch dimension): one per batch.
* Timesteps: ``sigmas = np.linspace(1.0, 1 / N, N)``; ``mu = calculate_shift(image_seq_len,
  scheduler.config["base_image_seq_len"] (256), ["max_image_seq_len"] (4096), ["base_shift"]
  (0.5), ["max_shift"] (1.15))`` with ``image_seq_len`` = packed token count;
  ``retrieve_timesteps(scheduler, N, sigmas=sigmas, mu=mu)``. In
  ``FlowMatchEulerDiscreteScheduler.set_timesteps``: dynamic shifting ->
  ``time_shift(mu, 1.0, sigmas)`` (exponential: ``e^mu / (e^mu + (1/s - 1))``), else
  ``shift * s / (1 + (shift - 1) * s)`` (schnell: shift 1 = identity); ``timesteps = sigmas * 1000``;
  a terminal sigma 0 is appended. ``use_flow_sigmas`` in the scheduler config drops ``sigmas``.
  ``scheduler.set_begin_index(0)`` before the loop.
* Denoiser: ``transformer(hidden_states=latents, timestep=t.expand(B) / 1000,
  guidance=full([B], guidance_scale) if transformer.config.guidance_embeds else None,
  pooled_projections, encoder_hidden_states, txt_ids, img_ids, joint_attention_kwargs)``; the
  transformer multiplies ``timestep`` and ``guidance`` by 1000 itself. Dev: ``guidance_scale`` is an
  input of the model (embedded guidance), there is no CFG batch doubling. Schnell:
  ``guidance_scale`` is ignored.
* True CFG: ``do_true_cfg = true_cfg_scale > 1 and negative_prompt (or negative embeds) given``;
  a second, separate transformer call on the negative embeddings (same latents, ids and guidance),
  ``noise = neg + true_cfg_scale * (cond - neg)``, no norm rescale. ``negative_prompt`` with
  ``true_cfg_scale <= 1`` is silently unused.
* Step: ``scheduler.step(noise, t, latents)`` (Euler: ``x + (sigma_next - sigma) * v``).
* Decode: ``_unpack_latents(latents, H, W, 8)`` -> (B, C, 2*(H//16), 2*(W//16));
  ``latents / vae.config.scaling_factor + vae.config.shift_factor``; ``vae.decode``;
  ``image_processor.postprocess`` (``(x / 2 + 0.5).clamp(0, 1)``).

``FluxKontextPipeline.__call__`` (``pipeline_flux_kontext.py``): same defaults and loop, plus
---------------------------------------------------------------------------------------------
* ``image=None`` (the FIRST positional parameter), ``max_area=1024**2``, ``_auto_resize=True``.
  The output size is ALWAYS rescaled to ``max_area`` keeping the aspect ratio:
  ``width = round(sqrt(max_area * w / h))``, ``height = round(sqrt(max_area * h / w))``, floored
  to multiples of 16 -- a 64x64 request gives 1024x1024 unless ``max_area=64*64`` is passed.
* Input image: its size -> with ``_auto_resize`` the closest aspect ratio of
  ``PREFERRED_KONTEXT_RESOLUTIONS`` (all ~1 MP), floored to multiples of 16; resized and
  normalised by ``image_processor``; ``_encode_vae_image``: ``(vae.encode(x).latent_dist.mode()
  - shift_factor) * scaling_factor`` (``sample_mode="argmax"``: no noise drawn), packed like the
  latents; its ids are ``[1, row, col]`` (first coordinate 1) and are appended to the latent ids
  (``torch.cat([latent_ids, image_ids], dim=0)``).
* Per step: ``hidden_states = torch.cat([latents, image_latents], dim=1)``; the prediction is
  sliced back ``noise[:, :latents.size(1)]``. ``mu`` uses the target latents' token count only.
  Without ``image`` it is text-to-image like Flux dev (after the ``max_area`` rescale).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, FluxKontextPipeline, FluxPipeline, FluxTransformer2DModel

from .components import autoencoder_kl, clip_text_model, clip_tokenizer, t5_encoder, t5_tokenizer

#: Scheduler settings of the real folders (``scheduler/scheduler_config.json`` of
#: black-forest-labs/FLUX.1-schnell, FLUX.1-dev and FLUX.1-Kontext-dev).
SCHEDULER_SCHNELL = dict(shift=1.0, use_dynamic_shifting=False, base_image_seq_len=256, max_image_seq_len=4096,
                         base_shift=0.5, max_shift=1.15)
SCHEDULER_DEV = dict(shift=3.0, use_dynamic_shifting=True, base_image_seq_len=256, max_image_seq_len=4096,
                     base_shift=0.5, max_shift=1.15)


def _flux_components(*, guidance_embeds: bool, seed: int, num_layers: int = 1, num_single_layers: int = 1) -> dict:
    torch.manual_seed(seed)
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=64,  # 16 latent channels x 2x2 packing, as in FLUX.1
        num_layers=num_layers,
        num_single_layers=num_single_layers,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,  # = T5 d_model
        pooled_projection_dim=32,  # = CLIP hidden size
        guidance_embeds=guidance_embeds,
        axes_dims_rope=(4, 6, 6),  # sums to attention_head_dim
    )
    tokenizer = clip_tokenizer(77)
    t5_tok = t5_tokenizer()
    return dict(
        transformer=transformer,
        text_encoder=clip_text_model(tokenizer, hidden_size=32),
        tokenizer=tokenizer,
        text_encoder_2=t5_encoder(len(t5_tok), d_model=32),
        tokenizer_2=t5_tok,
        vae=autoencoder_kl(latent_channels=16, scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False),
        scheduler=FlowMatchEulerDiscreteScheduler(**(SCHEDULER_DEV if guidance_embeds else SCHEDULER_SCHNELL)),
    )


def build_tiny_flux(out: Path, *, variant: Literal["schnell", "dev"] = "schnell", seed: int = 0,
                    num_layers: int = 1, num_single_layers: int = 1) -> Path:
    """Build a tiny random-weight ``FluxPipeline`` and ``save_pretrained`` it to ``out``.

    Args:
        out: folder to write (created if missing).
        variant: ``"schnell"`` (``guidance_embeds=False``, scheduler ``shift=1.0`` without dynamic
            shifting) or ``"dev"`` (``guidance_embeds=True``, dynamic shifting, ``shift=3.0``).
        seed: ``torch.manual_seed`` for the random weights (same seed -> same files).
        num_layers / num_single_layers: double- / single-stream transformer blocks (caches
            that skip middle blocks need several of each).

    Returns:
        ``out`` as a ``Path`` (~2 MB). Sizes must be multiples of 16 pixels; always pass
        ``height``/``width`` (the pipeline's default is 1024).

    Raises:
        ValueError: unknown ``variant``.
    """
    if variant not in ("schnell", "dev"):
        raise ValueError(f"variant must be 'schnell' or 'dev', got {variant!r}")
    pipe = FluxPipeline(**_flux_components(guidance_embeds=variant == "dev", seed=seed, num_layers=num_layers,
                                           num_single_layers=num_single_layers))
    out = Path(out)
    pipe.save_pretrained(out)
    return out


def build_tiny_flux_kontext(out: Path, *, seed: int = 0, num_layers: int = 1, num_single_layers: int = 1) -> Path:
    """Build a tiny random-weight ``FluxKontextPipeline`` (the Flux-dev components) into ``out``.

    Call it with ``max_area=height * width`` (and ``_auto_resize=False`` with an input image) for
    exact small sizes; otherwise the pipeline rescales to ~1024x1024.

    Returns:
        ``out`` as a ``Path`` (~2 MB).
    """
    pipe = FluxKontextPipeline(**_flux_components(guidance_embeds=True, seed=seed, num_layers=num_layers,
                                                  num_single_layers=num_single_layers))
    out = Path(out)
    pipe.save_pretrained(out)
    return out
