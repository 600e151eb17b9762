"""Tiny random-weight ``WanPipeline``: Wan 2.1 text-to-video and a Wan 2.2 two-expert variant.

Components: ``WanTransformer3DModel`` (``patch_size=(1, 2, 2)``, 2 heads of 12, ``text_dim`` = UMT5
``d_model`` = 32), ``UMT5EncoderModel`` + a character ``T5Tokenizer`` (pad 0, eos 1),
``AutoencoderKLWan`` with the real 8x spatial and 4x temporal down-sampling
(``dim_mult`` of 4 entries, ``temperal_downsample=[False, True, True]``: F = 4k + 1 frames ->
k + 1 latent frames; 16 latent channels with the real ``latents_mean``/``latents_std``), and
Wan2.1-T2V-1.3B-Diffusers' ``UniPCMultistepScheduler`` config (``prediction_type=
"flow_prediction"``, ``use_flow_sigmas=True``, ``flow_shift=3.0``, ``solver_order=2``,
``solver_type="bh2"``, ``predict_x0=True``, ``lower_order_final=True``,
``final_sigmas_type="zero"``). The Wan 2.2 variant (A14B layout) adds ``transformer_2`` (the
low-noise expert, other random weights) and ``boundary_ratio`` in ``model_index.json``
(pipeline config), 0.875 as in Wan2.2-T2V-A14B-Diffusers.

Parity notes: diffusers 0.42.1, ``pipelines/wan/pipeline_wan.py`` (``WanPipeline.__call__``)
------------------------------------------------------------------------------------------
* Defaults: ``height=480``, ``width=832``, ``num_frames=81``, ``num_inference_steps=50``,
  ``guidance_scale=5.0``, ``guidance_scale_2=None`` (-> ``guidance_scale`` when
  ``boundary_ratio`` is set; ``check_inputs`` raises if given without ``boundary_ratio``),
  ``negative_prompt=None`` (-> ``""`` under CFG), ``max_sequence_length=512``,
  ``output_type="np"`` (float frames in [0, 1], (B, F, H, W, 3)). ``check_inputs`` raises unless
  ``height``/``width`` are multiples of 16. ``num_frames`` with ``(F - 1) % 4 != 0`` only warns and
  becomes ``F // 4 * 4 + 1``; sizes are floored to multiples of ``vae.config.scale_factor_spatial``
  (a config key, 8) x patch (2). The temporal factor is ``vae.config.scale_factor_temporal`` (4),
  also a config key, not derived from ``temperal_downsample``.
* Text (``_get_t5_prompt_embeds``): ``prompt_clean`` (``ftfy.fix_text`` if ftfy is installed --
  it is not here --, ``html.unescape`` twice, whitespace collapsed, stripped); tokenized with
  ``padding="max_length"``, ``max_length=max_sequence_length``, EOS added; ``text_encoder(ids,
  mask).last_hidden_state``; each prompt cut to its real length and zero-padded back to
  ``max_sequence_length`` (no mask goes to the transformer: padding rows are exact zeros).
* CFG: ``do_classifier_free_guidance = guidance_scale > 1.0`` (``guidance_scale`` only, even for
  2.2); two separate transformer calls per step (cond, then uncond), ``noise = uncond +
  scale * (cond - uncond)``.
* Timesteps: ``scheduler.set_timesteps(N)`` with no sigmas/mu from the pipeline. UniPC flow
  sigmas: ``sigmas = linspace(1, 1/1000, N + 1)[:-1]``, ``flow_shift * s / (1 + (flow_shift - 1) *
  s)``, ``sigmas[0] -= 1e-6`` when it is 1, ``timesteps = (sigmas * 1000)`` cast to int64, final
  sigma 0. ``set_begin_index(0)``. The transformer gets ``timestep = t.expand(B)`` (raw 0..1000,
  NOT divided by 1000); ``expand_timesteps`` (Wan 2.2 TI2V) gives per-token timesteps instead.
* Two experts (``boundary_ratio`` set): ``boundary = boundary_ratio * num_train_timesteps``; a step
  with ``t >= boundary`` uses ``transformer`` and ``guidance_scale``, else ``transformer_2`` and
  ``guidance_scale_2``. The scheduler state runs across the switch.
* Latents: ``randn_tensor((B, 16, (F - 1) // 4 + 1, H // 8, W // 8), generator, dtype=float32)``;
  cast to the transformer dtype per call.
* Step: ``scheduler.step(noise, t, latents)``: UniPC is multistep predictor-corrector with state
  (``model_outputs``, ``timestep_list``, ``last_sample``, ``lower_order_nums``, ``this_order``,
  ``_step_index``): one scheduler instance per request.
* Decode: ``latents / (1 / latents_std) + latents_mean`` (``vae.config``, (1, 16, 1, 1, 1));
  ``vae.decode`` -> (B, 3, F, H, W); ``video_processor.postprocess_video``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel

from .components import t5_tokenizer, umt5_encoder

#: ``scheduler/scheduler_config.json`` of Wan-AI/Wan2.1-T2V-1.3B-Diffusers.
WAN21_SCHEDULER = dict(
    beta_end=0.02,
    beta_schedule="linear",
    beta_start=0.0001,
    disable_corrector=[],
    dynamic_thresholding_ratio=0.995,
    final_sigmas_type="zero",
    flow_shift=3.0,
    lower_order_final=True,
    num_train_timesteps=1000,
    predict_x0=True,
    prediction_type="flow_prediction",
    rescale_betas_zero_snr=False,
    sample_max_value=1.0,
    solver_order=2,
    solver_p=None,
    solver_type="bh2",
    steps_offset=0,
    thresholding=False,
    timestep_spacing="linspace",
    trained_betas=None,
    use_beta_sigmas=False,
    use_exponential_sigmas=False,
    use_flow_sigmas=True,
    use_karras_sigmas=False,
)

#: ``boundary_ratio`` of Wan-AI/Wan2.2-T2V-A14B-Diffusers' ``model_index.json``.
WAN22_BOUNDARY_RATIO = 0.875


def _transformer(num_layers: int = 2, num_attention_heads: int = 2, attention_head_dim: int = 12,
                 ffn_dim: int = 32) -> WanTransformer3DModel:
    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=num_attention_heads,
        attention_head_dim=attention_head_dim,
        in_channels=16,
        out_channels=16,
        text_dim=32,  # = UMT5 d_model
        freq_dim=256,
        ffn_dim=ffn_dim,
        num_layers=num_layers,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    )


def _wan_pipeline(*, two_experts: bool, boundary_ratio: float, seed: int, **shape) -> WanPipeline:
    torch.manual_seed(seed)
    tokenizer = t5_tokenizer()
    text_encoder = umt5_encoder(len(tokenizer), d_model=32)
    vae = AutoencoderKLWan(
        base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
    )
    transformer = _transformer(**shape)
    transformer_2 = _transformer(**shape) if two_experts else None
    return WanPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=vae,
        scheduler=UniPCMultistepScheduler(**WAN21_SCHEDULER),
        transformer=transformer,
        transformer_2=transformer_2,
        boundary_ratio=boundary_ratio if two_experts else None,
    )


def build_tiny_wan(out: Path, *, seed: int = 0, **shape) -> Path:
    """Build a tiny random-weight Wan 2.1 T2V ``WanPipeline`` and ``save_pretrained`` it to ``out``.

    Args:
        out: folder to write (created if missing).
        seed: ``torch.manual_seed`` for the random weights.
        shape: ``num_layers`` (2), ``num_attention_heads`` (2), ``attention_head_dim``
            (12), ``ffn_dim`` (32) of the transformer (benchmarks widen it).

    Returns:
        ``out`` as a ``Path`` (~1 MB). Always pass ``height``/``width`` (multiples of 16) and
        ``num_frames`` (4k + 1); the pipeline's defaults are 480x832, 81 frames.
    """
    pipe = _wan_pipeline(two_experts=False, boundary_ratio=0.0, seed=seed, **shape)
    out = Path(out)
    pipe.save_pretrained(out)
    return out


def build_tiny_wan22(out: Path, *, boundary_ratio: float = WAN22_BOUNDARY_RATIO, seed: int = 0) -> Path:
    """Build a tiny Wan 2.2 two-expert ``WanPipeline`` (``transformer`` for ``t >= boundary_ratio *
    1000``, ``transformer_2`` below) and ``save_pretrained`` it to ``out``.

    With the Wan 2.1 scheduler (``flow_shift=3.0``) 2 steps run at t = 999 and 750, one on each
    expert for the default ``boundary_ratio`` 0.875.

    Args:
        out: folder to write (created if missing).
        boundary_ratio: in (0, 1); written to ``model_index.json``.
        seed: ``torch.manual_seed`` for the random weights (the two experts differ).

    Returns:
        ``out`` as a ``Path`` (~1 MB).

    Raises:
        ValueError: ``boundary_ratio`` outside (0, 1).
    """
    if not 0.0 < boundary_ratio < 1.0:
        raise ValueError(f"boundary_ratio must be in (0, 1), got {boundary_ratio}")
    pipe = _wan_pipeline(two_experts=True, boundary_ratio=boundary_ratio, seed=seed)
    out = Path(out)
    pipe.save_pretrained(out)
    return out
