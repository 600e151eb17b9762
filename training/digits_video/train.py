"""Train diffserve's built-in text-to-video model (a tiny Wan 2.1 T2V pipeline) on moving digits.

Run::

    python -m training.digits_video.train --out diffserve/models/digits_video/weights --seed 0

The result is a standard diffusers ``WanPipeline`` folder built only from diffusers' and
transformers' own classes, so ``WanPipeline.from_pretrained(out)`` loads it with no diffserve
code. Clips are 9 RGB frames of 16x16 pixels (see :mod:`training.digits_video.data`).

Components (all randomly initialised, trained here on CPU):

* ``AutoencoderKLWan``: Wan's causal 3D VAE with 4x temporal down-sampling
  (``temperal_downsample=[True, True]``: 9 frames -> 3 latent frames, Wan's ``4k + 1`` rule) and
  4x spatial down-sampling (two levels; 16x16 -> 4x4), ``z_dim`` latent channels. Trained first,
  through its own chunked causal ``encode`` and decode loop (:func:`decode_unclamped`);
  ``latents_mean``/``latents_std`` are set per channel so the pipeline's normalised latents have
  zero mean and unit variance.
* ``UMT5EncoderModel`` with the offline tokenizer of :mod:`diffserve.models.digits_video.tokenizer`.
* ``WanTransformer3DModel`` (patch (1, 2, 2): 3 x 2 x 2 = 12 tokens per clip) trained jointly with
  the text encoder by rectified flow (Esser et al. 2024, arXiv:2403.03206; the objective of Wan,
  arXiv:2503.20314): ``x_t = (1 - t) x0 + t noise``, ``t`` logit-normal(0, 1), the transformer gets
  ``timestep = 1000 t`` and regresses ``noise - x0``. 10 % of captions are replaced by ``""`` (the
  pipeline's default negative prompt) for classifier-free guidance.
* A flow-matching scheduler (see :func:`build_scheduler`).

Text conditioning is computed by the pipeline's own ``encode_prompt`` with the pipeline's default
``max_sequence_length`` (512), exactly as at inference; the zero padding rows are folded into one
row (:mod:`diffserve.pipelines.wan.context_folding`, which diffserve also uses to serve Wan
models), an exact identity.
"""

from __future__ import annotations

import argparse
import inspect
import json
import platform
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from diffusers import (
    AutoencoderKLWan,
    FlowMatchEulerDiscreteScheduler,
    UniPCMultistepScheduler,
    WanPipeline,
    WanTransformer3DModel,
)
from transformers import UMT5Config, UMT5EncoderModel

from training import common as training
from training.digits import data as digit_data
from training.digits_video import data
from diffserve.models.digits_video import DEFAULT_MODEL_PATH
from diffserve.models.digits_video.tokenizer import VOCABULARY_WORDS, build_umt5_tokenizer
from training.common import QUALITY_BEGIN, QUALITY_END, folder_bytes, loss_table
from diffserve.pipelines.video_chunks import per_token_timesteps
from diffserve.pipelines.wan.context_folding import (
    append_folded_row,
    install_folded_cross_attention,
    set_max_sequence_length,
    uninstall_folded_cross_attention,
)

PACKAGE_DIR = DEFAULT_MODEL_PATH.parent
DEFAULT_WEIGHTS_DIR = PACKAGE_DIR / "weights"
PACKAGE_MODEL_CARD = PACKAGE_DIR / "MODEL_CARD.md"
#: ``WanPipeline.__call__``'s default ``max_sequence_length``: prompts are padded to this many rows.
MAX_SEQUENCE_LENGTH: int = inspect.signature(WanPipeline.__call__).parameters["max_sequence_length"].default
#: Sampling defaults shipped with the model (``generation_config.json``): the settings its judge
#: numbers are reported at. ``WanPipeline``'s own defaults (480x832, 81 frames) do not apply.
GENERATION_DEFAULTS = {
    "num_inference_steps": 20,
    "guidance_scale": 4.0,
    "height": data.CANVAS_SIZE,
    "width": data.CANVAS_SIZE,
    "num_frames": data.NUM_FRAMES,
    "fps": data.FPS,
    # what the model was trained for: diffserve refuses larger sizes and longer clips
    "limits": {"max_height": data.CANVAS_SIZE, "max_width": data.CANVAS_SIZE, "max_num_frames": data.NUM_FRAMES},
}


@dataclass(frozen=True)
class ModelSize:
    """Architecture hyper-parameters of the pipeline's components."""

    text_d_model: int = 32
    text_layers: int = 2
    text_heads: int = 4
    text_d_kv: int = 8
    text_d_ff: int = 64
    transformer_layers: int = 4
    transformer_heads: int = 4
    transformer_head_dim: int = 32
    transformer_ffn: int = 256
    freq_dim: int = 256
    vae_base_dim: int = 16
    vae_dim_mult: tuple[int, ...] = (1, 2, 4)
    vae_res_blocks: int = 1
    z_dim: int = 16


FULL_SIZE = ModelSize()
TINY_SIZE = ModelSize(
    text_d_model=8, text_layers=1, text_heads=2, text_d_kv=4, text_d_ff=16, transformer_layers=1,
    transformer_heads=2, transformer_head_dim=12, transformer_ffn=32, freq_dim=32, vae_base_dim=4, z_dim=4,
)


@dataclass(frozen=True, kw_only=True)
class TrainConfig(training.TrainConfig):
    """Optimisation settings; the defaults are the ones used for the shipped model."""

    minutes: float = 90.0
    batch_size: int = 64
    vae_batch_size: int = 16
    #: latent pool: clips per training digit encoded once for the denoiser phase
    clips_per_digit: int = 12
    #: fraction of switch clips (frame 0 shows another digit; ``data.SWITCH_PROB``)
    switch_prob: float = data.SWITCH_PROB
    #: fraction of denoiser examples whose latent frame 0 is clean with timestep-0 tokens
    #: (first-frame conditioning, :func:`rectified_flow_loss`)
    first_frame_prob: float = 0.3


def build_scheduler() -> UniPCMultistepScheduler:
    """The shipped diffusion scheduler: UniPC (Zhao et al. 2023, arXiv:2302.04867) on flow sigmas.

    Wan 2.1's diffusers folders ship ``UniPCMultistepScheduler(prediction_type="flow_prediction",
    use_flow_sigmas=True, flow_shift=...)``; a multistep predictor-corrector reaches a given
    quality in fewer steps than first-order Euler. ``flow_shift=1.0`` (no shift): Wan's 3.0/5.0
    compensate for 480p/720p token counts, this model's latents are 12 tokens.
    """
    return UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, num_train_timesteps=1000, flow_shift=1.0
    )


def euler_scheduler() -> FlowMatchEulerDiscreteScheduler:
    """The alternative flow-matching scheduler (first-order Euler, shift 1.0), for comparisons."""
    return FlowMatchEulerDiscreteScheduler(shift=1.0)


def build_pipeline(size: ModelSize = FULL_SIZE) -> WanPipeline:
    """Build an untrained Wan 2.1 T2V pipeline for 16x16 RGB clips (uses the global torch RNG).

    Returns:
        ``WanPipeline`` on CPU, float32. The VAE maps (B, 3, 4k+1, 16, 16) video in [-1, 1] to
        (B, z_dim, k+1, 4, 4) latents; the transformer sees (k+1) x 2 x 2 patches of (1, 2, 2).
    """
    tokenizer = build_umt5_tokenizer()
    text_encoder = UMT5EncoderModel(
        UMT5Config(
            vocab_size=len(tokenizer),
            d_model=size.text_d_model,
            d_kv=size.text_d_kv,
            d_ff=size.text_d_ff,
            num_layers=size.text_layers,
            num_heads=size.text_heads,
            relative_attention_num_buckets=16,
            relative_attention_max_distance=32,
            feed_forward_proj="gated-gelu",
            dropout_rate=0.0,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            decoder_start_token_id=tokenizer.pad_token_id,
        )
    )
    levels = len(size.vae_dim_mult) - 1
    vae = AutoencoderKLWan(
        base_dim=size.vae_base_dim,
        z_dim=size.z_dim,
        dim_mult=list(size.vae_dim_mult),
        num_res_blocks=size.vae_res_blocks,
        attn_scales=[],
        temperal_downsample=[True] * levels,
        latents_mean=[0.0] * size.z_dim,
        latents_std=[1.0] * size.z_dim,
        scale_factor_spatial=2**levels,
        scale_factor_temporal=2**levels,
    )
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=size.transformer_heads,
        attention_head_dim=size.transformer_head_dim,
        in_channels=size.z_dim,
        out_channels=size.z_dim,
        text_dim=size.text_d_model,
        freq_dim=size.freq_dim,
        ffn_dim=size.transformer_ffn,
        num_layers=size.transformer_layers,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=64,
    )
    return WanPipeline(
        tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=build_scheduler(), transformer=transformer,
        expand_timesteps=True,  # per-token timesteps: first-frame conditioning (Wan 2.2 TI2V), see rectified_flow_loss
    )


class ClipSampler:
    """Random training clips of the training split's digits (the held-out 20 % are never used).

    Args:
        seed: seeds the choice of digits, directions and positions.
    """

    def __init__(self, seed: int, device: torch.device | str = "cpu", switch_prob: float = data.SWITCH_PROB):
        split = digit_data.load_split()
        self.switch_prob = switch_prob
        self.images = split.train_images
        self.labels = split.train_labels
        self.rng = random.Random(seed)
        self.device = torch.device(device)

    def batch(self, size: int) -> torch.Tensor:
        """``size`` random clips as float32 (size, 3, F, 16, 16) in [-1, 1], on ``device``."""
        idx = [self.rng.randrange(len(self.images)) for _ in range(size)]
        specs = data.sample_specs(self.labels[idx], self.rng)
        firsts = data.sample_first_images(self.labels[idx], self.images, self.labels, self.rng, self.switch_prob)
        frames, _ = data.make_clips(self.images[idx], specs, self.rng, first_images=firsts)
        return data.to_model_range(frames).to(self.device)


def decode_unclamped(vae: AutoencoderKLWan, z: torch.Tensor) -> torch.Tensor:
    """``vae.decode(z).sample`` without its final clamp to [-1, 1], for training.

    Same chunked causal loop as diffusers' ``AutoencoderKLWan._decode`` (one latent frame at a
    time through the decoder's feature cache; no tiling, no patchify). The clamp has zero
    gradient wherever the output leaves [-1, 1]; on these mostly black clips a decoder that
    undershoots the background everywhere would then get no gradient at all and stay black.

    Args:
        z: (B, z_dim, F', h, w) latents.

    Returns:
        (B, 3, 4 (F' - 1) + 1, 4h, 4w) video, not clamped.
    """
    vae.clear_cache()
    x = vae.post_quant_conv(z)
    frames = []
    for i in range(x.shape[2]):
        vae._conv_idx = [0]
        frames.append(vae.decoder(x[:, :, i : i + 1], feat_cache=vae._feat_map, feat_idx=vae._conv_idx,
                                  first_chunk=i == 0))
    vae.clear_cache()
    return torch.cat(frames, 2)


def vae_loss(vae: AutoencoderKLWan, clips: torch.Tensor, kl_weight: float) -> torch.Tensor:
    """Reconstruction MSE from a posterior sample (decoded by :func:`decode_unclamped`) +
    ``kl_weight`` x KL(q(z|x) || N(0, 1)) per pixel.

    Args:
        clips: float32 (B, 3, F, H, W) in [-1, 1].

    Returns:
        Scalar loss (Kingma & Welling 2014, with the KL summed over latent elements and divided
        by the number of pixel values, as for the image model).
    """
    posterior = vae.encode(clips).latent_dist
    recon = decode_unclamped(vae, posterior.sample())
    kl = 0.5 * (posterior.mean.pow(2) + posterior.var - 1.0 - posterior.logvar).flatten(1).sum(1)
    return F.mse_loss(recon, clips) + kl_weight * kl.mean() / clips[0].numel()


def train_vae(
    vae: AutoencoderKLWan, sampler: ClipSampler, config: TrainConfig, deadline: float
) -> list[tuple[int, float]]:
    """Train ``vae`` in place on random training clips (:func:`vae_loss` on batches of
    ``config.vae_batch_size`` clips; Adam, cosine decay, gradient norm clipped to 1.0; stops at
    ``deadline``; the loop is :func:`training.common.train_vae`).

    Returns:
        ``(step, mean loss over the last log interval)`` pairs (about 10 of them at least).
    """
    return training.train_vae(
        vae,
        lambda: vae_loss(vae, sampler.batch(config.vae_batch_size), config.vae_kl_weight),
        config,
        deadline,
        log_every=max(1, min(config.log_every, config.vae_steps // 10)),
        clip_grad_norm=1.0,
    )


@torch.no_grad()
def encode_latent_pool(
    vae: AutoencoderKLWan, config: TrainConfig, chunk: int = 64
) -> tuple[torch.Tensor, list[data.ClipSpec]]:
    """Encode ``clips_per_digit`` clips of every training digit; set the VAE's latent statistics.

    Each training digit gets the 4 directions in turn, at random positions; a fraction
    ``config.switch_prob`` are switch clips (``data.sample_first_images``).
    ``vae.config.latents_mean``/``latents_std`` are set to the per-channel mean/std of the
    posterior means, so ``(mu - mean) / std`` has zero mean and unit variance per channel; the
    pipeline inverts it (``latents * std + mean``) before decoding.

    Returns:
        ``(x0, specs)``: float32 (N, z_dim, F', h, w) normalised latents (N = 1437 x
        clips_per_digit) and each clip's :class:`~training.digits_video.data.ClipSpec`.
    """
    split = digit_data.load_split()
    rng = random.Random(config.seed + 3)
    directions = data.DIRECTION_NAMES
    specs, images = [], []
    for k in range(config.clips_per_digit):
        for image, label in zip(split.train_images, split.train_labels):
            specs.append(data.ClipSpec(int(label), directions[k % len(directions)]))
            images.append(image)
    firsts = data.sample_first_images(np.array([s.digit for s in specs]), split.train_images, split.train_labels,
                                      rng, config.switch_prob)
    means = []
    for lo in range(0, len(specs), chunk):
        frames, _ = data.make_clips(np.stack(images[lo : lo + chunk]), specs[lo : lo + chunk], rng,
                                    first_images=firsts[lo : lo + chunk])
        means.append(vae.encode(data.to_model_range(frames).to(vae.device)).latent_dist.mean)
    mu = torch.cat(means)
    mean = mu.mean(dim=(0, 2, 3, 4)).cpu()
    std = mu.std(dim=(0, 2, 3, 4)).cpu()
    vae.register_to_config(latents_mean=mean.tolist(), latents_std=std.tolist())
    shape = (1, -1, 1, 1, 1)
    return (mu - mean.view(shape).to(mu.device)) / std.view(shape).to(mu.device), specs


def encode_prompts(pipe: WanPipeline, prompts: list[str], fold: bool = True) -> torch.Tensor:
    """Prompt embeddings as ``WanPipeline.__call__`` computes them (``max_sequence_length`` 512).

    Args:
        fold: return the folded form instead of the 512 rows: the UMT5 encoder runs only over
            the longest prompt's ``L`` tokens (its attention mask hides padding, and its relative
            position bias depends only on distances, so the real tokens' outputs are the same),
            and the ``512 - L`` zero rows that follow become ONE zero row
            (:func:`~diffserve.pipelines.wan.context_folding.append_folded_row`).

    Returns:
        float32 (B, 512, text_d_model) when ``fold`` is False, else (B, L + 1, text_d_model)
        whose last row stands for the ``512 - L`` padding rows. Rows past a prompt's length are
        zero.

    Raises:
        ValueError: if a prompt is too long to leave a padding row (>= 512 tokens).
    """
    if not fold:
        embeds, _ = pipe.encode_prompt(
            prompt=prompts, do_classifier_free_guidance=False, max_sequence_length=MAX_SEQUENCE_LENGTH
        )
        return embeds
    longest = max(len(ids) for ids in pipe.tokenizer(prompts).input_ids)
    if longest >= MAX_SEQUENCE_LENGTH:
        raise ValueError(f"prompt of {longest} tokens leaves no padding row (max_sequence_length {MAX_SEQUENCE_LENGTH})")
    embeds, _ = pipe.encode_prompt(prompt=prompts, do_classifier_free_guidance=False, max_sequence_length=longest)
    return append_folded_row(embeds, MAX_SEQUENCE_LENGTH)


def rectified_flow_loss(
    pipe: WanPipeline,
    x0: torch.Tensor,
    prompts: list[str],
    generator: torch.Generator,
    fold: bool = True,
    first_frame_prob: float = 0.0,
) -> torch.Tensor:
    """Rectified-flow loss (Esser et al. 2024, arXiv:2403.03206, sections 2-3) for a Wan transformer,
    with first-frame conditioning examples (Wan 2.2 TI2V, arXiv:2503.20314).

    Timesteps are given per patch token (``expand_timesteps``, shape (B, tokens)). With
    probability ``first_frame_prob`` an example is *conditioned*: its latent frame 0 is the clean
    ``x0`` frame, its tokens get timestep 0, and the loss leaves frame 0 out, so the model learns
    to continue a given first frame (what a stream chunk asks: ``diffserve.pipelines.video_chunks``)
    while the others stay ordinary text-to-video examples.

    Args:
        x0: float32 (B, z_dim, F', h, w) normalised VAE latents.
        prompts: B prompts, encoded as by the pipeline (:func:`encode_prompts`).
        generator: CPU generator for ``t``, the noise and the conditioned examples.
        fold: fold the zero padding rows into one row (the transformer must have
            :class:`~diffserve.pipelines.wan.context_folding.FoldedCrossAttnProcessor` s:
            ``install_folded_cross_attention``); ``False`` runs the stock 512-row forward.
        first_frame_prob: fraction of conditioned examples (0: plain text-to-video).

    Returns:
        Scalar mean squared error between the transformer output and ``noise - x0`` at
        ``x_t = (1 - t) x0 + t noise``, ``t = sigmoid(N(0, 1))``, ``timestep = 1000 t``, over
        the latent values the loss counts.
    """
    embeds = encode_prompts(pipe, prompts, fold)
    batch, frames = x0.shape[0], x0.shape[2]
    t = torch.sigmoid(torch.randn(batch, generator=generator)).to(x0.device)
    noise = torch.randn(x0.shape, generator=generator).to(x0.device)
    conditioned = (torch.rand(batch, generator=generator) < first_frame_prob).to(x0.device)
    tt = t.view(-1, 1, 1, 1, 1)
    x_t = (1 - tt) * x0 + tt * noise
    first = conditioned.view(-1, 1, 1, 1)
    x_t[:, :, 0] = torch.where(first, x0[:, :, 0], x_t[:, :, 0])
    p_t, p_h, p_w = pipe.transformer.config.patch_size
    timestep = per_token_timesteps(t * 1000, conditioned.long(), frames // p_t, (x0.shape[3] // p_h) * (x0.shape[4] // p_w))
    set_max_sequence_length(pipe.transformer, MAX_SEQUENCE_LENGTH if fold else None)
    pred = pipe.transformer(hidden_states=x_t, timestep=timestep, encoder_hidden_states=embeds, return_dict=False)[0]
    weight = torch.ones(batch, 1, frames, 1, 1, device=x0.device)
    weight[:, :, 0] = torch.where(conditioned.view(-1, 1, 1, 1), 0.0, 1.0)
    weight = weight.expand_as(pred)
    return ((pred - (noise - x0)) ** 2 * weight).sum() / weight.sum()


def train_denoiser(
    pipe: WanPipeline,
    latents: torch.Tensor,
    specs: list[data.ClipSpec],
    config: TrainConfig,
    deadline: float,
) -> tuple[list[tuple[int, float]], int]:
    """Train the transformer and the text encoder jointly; leaves their EMA weights in ``pipe``.

    The loop (AdamW, warm-up then cosine decay, EMA, deadline) is
    :func:`training.common.train_denoiser`; the loss is :func:`rectified_flow_loss` with
    the padding rows folded, on prompts from ``data.sample_training_prompts``.

    Args:
        latents: float32 (N, z_dim, F', h, w) normalised latents of the pool clips.
        specs: the N clips' specs (digit, direction), for their prompts.

    Returns:
        ``(loss curve as (step, mean loss of the interval) pairs, steps done)``.
    """
    install_folded_cross_attention(pipe.transformer)
    modules = [pipe.transformer, pipe.text_encoder]

    def batch_loss(idx: torch.Tensor, prompt_rng: random.Random, generator: torch.Generator) -> torch.Tensor:
        prompts = data.sample_training_prompts([specs[i] for i in idx.tolist()], prompt_rng, config.empty_prompt_prob)
        return rectified_flow_loss(pipe, latents[idx.to(latents.device)], prompts, generator,
                                   first_frame_prob=config.first_frame_prob)

    curve, steps = training.train_denoiser(modules, len(latents), batch_loss, config, deadline)
    uninstall_folded_cross_attention(pipe.transformer)
    return curve, steps


def _resume_note(facts: dict) -> str:
    """Card line saying which folder a ``--resume`` run continued from ("" for a fresh run)."""
    if facts["resumed_from"] is None:
        return ""
    return (f"- Continued (`--resume`) from `{facts['resumed_from']}`: its VAE is kept as trained there (the VAE "
            "line below describes that run's settings), the latent pool is re-encoded, and the denoiser is "
            "trained further from its weights.\n")


def _vae_final(facts: dict) -> str:
    """Card text with the VAE's final training loss ("" when this run had no VAE phase)."""
    return f"; final loss {facts['vae_curve'][-1][1]:.5f}" if facts["vae_curve"] else ""


def write_model_card(path: Path, facts: dict) -> None:
    """Write the model card (markdown) to ``path`` from the facts gathered by :func:`main`.

    The judge section (between ``QUALITY_BEGIN``/``QUALITY_END``) is left empty: it is filled in
    by ``benchmarks/quality_video.py --update-card``; a fresh training run resets it, since old
    numbers would describe other weights.
    """
    size: ModelSize = facts["size"]
    config: TrainConfig = facts["config"]
    p = facts["params"]
    vocab = ", ".join(f"`{w}`" for w in VOCABULARY_WORDS)
    motion = "\n".join(f"- `{t}`" for t in data.MOTION_TEMPLATES)
    levels = len(size.vae_dim_mult) - 1
    g = GENERATION_DEFAULTS
    card = f"""# diffserve built-in model: `digits-video` (text-to-video, moving handwritten digits)

A tiny Wan 2.1 text-to-video pipeline trained from scratch on clips made from scikit-learn's
bundled handwritten digits (`sklearn.datasets.load_digits`, 8x8 pixels): one digit moving left,
right, up or down across a black {data.CANVAS_SIZE}x{data.CANVAS_SIZE} canvas that wraps around, {data.SPEED} pixel per frame,
{data.NUM_FRAMES} frames, starting anywhere along the motion (so a clip can continue where another ended: stream chunks). It exercises the real Wan code path (UMT5 text encoder,
`WanTransformer3DModel`, causal 3D `AutoencoderKLWan` with 4x temporal compression, flow-matching
scheduler) and is small enough to ship in the package and run on a CPU in tests.

```python
import json
from diffusers import WanPipeline
from diffserve.models.digits_video import DEFAULT_MODEL_PATH

pipe = WanPipeline.from_pretrained(DEFAULT_MODEL_PATH)
defaults = json.loads((DEFAULT_MODEL_PATH / "generation_config.json").read_text())
fps = defaults.pop("fps")  # playback rate, not a pipeline argument
defaults.pop("limits")  # the largest size and length it was trained for (diffserve refuses more)
video = pipe("a handwritten digit 3 moving left", **defaults).frames[0]  # (9, 16, 16, 3) floats in [0, 1]
```

`WanPipeline.__call__` has fixed defaults of its own (480x832, 81 frames, 50 steps) that do not
read the folder, so pass the shipped `generation_config.json` ({json.dumps(g)}) as above;
diffserve reads it as the model's sampling defaults. The model was trained on {g['limits']['max_height']}x{g['limits']['max_width']} clips of
{g['limits']['max_num_frames']} frames and states so in the file's `limits`; diffserve refuses larger sizes and longer clips
(`height`/`width`: multiples of 16, a `WanPipeline` rule, at most {g['limits']['max_height']}: so exactly {g['limits']['max_height']}; `num_frames`: of the
form 4k+1, at most {g['limits']['max_num_frames']}: 1, 5 or 9), before the weights load where it can. Pixels: black background, white strokes,
three equal channels.

## Architecture

| component | class | config | parameters |
|---|---|---|---:|
| transformer | `WanTransformer3DModel` | {size.transformer_layers} layers, {size.transformer_heads} heads x {size.transformer_head_dim}, ffn {size.transformer_ffn}, patch (1, 2, 2), text_dim {size.text_d_model}, freq_dim {size.freq_dim}, cross_attn_norm, qk RMS norm | {p["transformer"]:,} |
| text_encoder | `UMT5EncoderModel` | {size.text_layers} layers, d_model {size.text_d_model}, {size.text_heads} heads x {size.text_d_kv}, d_ff {size.text_d_ff} (gated-gelu), 16 relative-position buckets | {p["text_encoder"]:,} |
| vae | `AutoencoderKLWan` | base_dim {size.vae_base_dim}, dim_mult {list(size.vae_dim_mult)}, {size.vae_res_blocks} res block(s) per level, z_dim {size.z_dim}, `temperal_downsample` {[True] * levels} (4x in time), `scale_factor_spatial` {2 ** levels}, per-channel latents_mean/std from the training clips | {p["vae"]:,} |
| scheduler | `UniPCMultistepScheduler` | `prediction_type="flow_prediction"`, `use_flow_sigmas=True`, `flow_shift=1.0` | - |
| tokenizer | `T5Tokenizer` | Unigram, {facts["vocab_size"]} pieces: ASCII characters + whole words | - |

Total parameters: {p["total"]:,}. Folder size: {facts["folder_bytes"] / 1e6:.2f} MB (safetensors, float32).

Shapes: a clip (1, 3, {data.NUM_FRAMES}, {data.CANVAS_SIZE}, {data.CANVAS_SIZE}) encodes to a latent (1, {size.z_dim}, {(data.NUM_FRAMES - 1) // 4 + 1}, {data.CANVAS_SIZE // 2 ** levels}, {data.CANVAS_SIZE // 2 ** levels})
(the first frame alone, then 4 frames per latent frame, Wan's causal layout); the transformer
sees {(data.NUM_FRAMES - 1) // 4 + 1} x {data.CANVAS_SIZE // 2 ** levels // 2} x {data.CANVAS_SIZE // 2 ** levels // 2} = {((data.NUM_FRAMES - 1) // 4 + 1) * (data.CANVAS_SIZE // 2 ** levels // 2) ** 2} tokens and cross-attends to the 512 rows of prompt
embeddings (`max_sequence_length` 512, zero rows after the prompt).

Why 4x and not Wan's 8x spatial down-sampling: `WanPipeline` requires `height`/`width` to be
multiples of 16, and a 16x16 canvas is what one CPU thread can train in the time budget (a
32x32 canvas makes every VAE step 4x dearer). With 8x on 16x16 the latent would be 2x2: ONE
transformer token per latent frame (patch 2x2), with no spatial layout left to attend over.
With 4x it is 4x4, 2x2 tokens per latent frame. Wan's VAE ties each temporal down-sampling to a
spatial one, so 4x in time needs at least 2 levels (4x in space): this is the smallest VAE that
keeps Wan's `4k + 1` frame rule.

Why UniPC: it is what Wan 2.1's own folders ship (with `flow_shift` 3.0/5.0 for 480p/720p; 1.0
here, since the latent has {((data.NUM_FRAMES - 1) // 4 + 1) * (data.CANVAS_SIZE // 2 ** levels // 2) ** 2} tokens), and as a multistep predictor-corrector it
reaches a given quality in fewer steps than first-order Euler; the judge table below compares
both at the same step counts.

## Training

Command (wall time {facts["wall_s"] / 60:.1f} min, process CPU time {facts["cpu_s"] / 60:.1f} min, on
{config.threads} CPU thread(s), {platform.processor() or platform.machine()}, torch {torch.__version__}, seed {config.seed}; the machine
was shared, so the wall time is an upper bound):

```
{facts["command"]}
```

- Data: the image model's fixed stratified 80/20 split of `load_digits` (`train_test_split(
  test_size=0.2, stratify=y, random_state=0)`): clips are made only from the 1437 training
  digits; the 360 held-out digits are never trained on. A clip pastes the 8x8 digit at integer
  positions (exact copies, no resampling) on a black canvas that wraps around (a digit past an
  edge comes back in at the opposite one), moving {data.SPEED} pixel per frame in one of 4
  directions from a uniform start along the motion; the position across it is uniform (the digit
  whole). A fraction {config.switch_prob} are *switch clips*: frame 0 shows a training digit of another label
  at the same place, the caption names the digit of frames 1.. (what a stream interaction asks:
  continue the previous chunk's last frame with the new prompt's digit). Intensities 0..16 scaled
  to [-1, 1], copied to 3 channels.
{_resume_note(facts)}- VAE: {facts["vae_steps"]} Adam steps on fresh random clips (lr {config.vae_lr}, batch {config.vae_batch_size}), MSE + {config.vae_kl_weight} x KL
  (summed over latent elements, divided by the number of pixel values), through the VAE's own
  chunked causal `encode` and its `decode` loop without the final clamp to [-1, 1] (the clamp
  has zero gradient below -1, and on mostly black clips a decoder that undershoots everywhere
  then never recovers: the first attempt collapsed to black clips){_vae_final(facts)}.
- Latent pool: {config.clips_per_digit} clips per training digit ({facts["pool_size"]:,} clips: each direction
  {config.clips_per_digit // 4} times at random positions), encoded once to posterior means; per-channel
  `latents_mean`/`latents_std` set from them.
- Denoiser: rectified flow as in SD3 / Wan: `x_t = (1-t) x0 + t noise`, `t ~ logit-normal(0, 1)`,
  `timestep = 1000 t`, target `noise - x0`; transformer and text encoder trained jointly from
  scratch. {facts["steps"]} AdamW steps (lr {config.lr}, weight decay {config.weight_decay}, batch {config.batch_size}, {config.warmup_steps} warm-up steps then
  cosine), gradient clipping 1.0, EMA {config.ema_decay} (the shipped weights are the EMA).
- First-frame conditioning (Wan 2.2 TI2V's, arXiv:2503.20314): timesteps are given per patch
  token (`expand_timesteps: true` in `model_index.json`; diffusers' `WanPipeline` then passes
  them per token, equal for plain text-to-video), and in a fraction {config.first_frame_prob} of the examples latent
  frame 0 is the clean latent with timestep-0 tokens, left out of the loss. diffserve's streams
  condition every chunk after the first this way on the previous chunk's last frame.
- Prompts: a training subject template of the image model (`a handwritten digit {{d}}`, `the number
  {{word}}`, ...) followed by a motion phrase; `""` with probability {config.empty_prompt_prob} (classifier-free
  guidance; `""` is the pipeline's default negative prompt). Conditioning is computed by the pipeline's own `encode_prompt`
  with `max_sequence_length=512`; the zero padding rows are folded into one row with attention
  logit `+log(count)` (an exact identity, `diffserve.pipelines.wan.context_folding`, which diffserve
  also serves Wan models with; checked in `tests/models/test_digits_video.py`); the saved weights
  work unchanged in diffusers.

### Loss curve (denoiser)

{loss_table(facts["curve"], rows=15)}

## Quality (judge)

{QUALITY_BEGIN}
Not measured yet for these weights. Run `python benchmarks/quality_video.py --update-card`.
{QUALITY_END}

## Prompts and vocabulary

A prompt is a subject (any of the image model's templates, see
`diffserve/models/digits/MODEL_CARD.md`) followed by a motion phrase; `{{dir}}` is `left`, `right`,
`up` or `down`:

{motion}

Whole-word pieces: {vocab}. Other text is spelled out in characters (never the unknown token for
ASCII), but the model has never seen it; `diffserve.models.digits_video.out_of_vocabulary_words(prompt)`
lists such words. The tokenizer is case-sensitive (`Moving` is not the trained `moving`).

## Limitations

- {data.CANVAS_SIZE}x{data.CANVAS_SIZE}, {data.NUM_FRAMES} frames, one digit, straight wrap-around motion at one speed only;
  other sizes and frame counts are outside the training distribution (longer videos: stream
  chunks, `num_chunks`).
- The first frame of a clip generated from scratch may show another digit than the prompt's (the
  switch clips of the training data); the judge's per-frame identity counts it.
- Knows only the ten digits and four directions; anything else gives an arbitrary clip.
- The digit's shape is not perfectly constant from frame to frame (the VAE packs 4 frames into one
  latent frame); the judge's "all frames right" column measures how often every frame is legible.
- Trained on 1437 digits: samples stay close to the training set (see novelty in the judge section).
- The judge is an RBF SVM on the same training split plus a centre-of-mass motion estimate; a
  proxy for legibility and motion, not for human judgement.
"""
    path.write_text(card)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line arguments (see module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    training.add_run_arguments(parser, TrainConfig)
    parser.add_argument("--vae-steps", type=int, default=None, help=f"VAE steps (default {TrainConfig.vae_steps})")
    parser.add_argument("--max-steps", type=int, default=None,
                        help=f"denoiser steps (default {TrainConfig.max_steps}); also sets the LR schedule; 0 = a "
                        "VAE-only run (the transformer and text encoder are saved as initialised, for --resume)")
    parser.add_argument("--threads", type=int, default=TrainConfig.threads, help="torch.set_num_threads")
    parser.add_argument("--device", default="cpu", help="torch device (the shipped model was trained on cpu)")
    parser.add_argument("--resume", type=Path, default=None,
                        help="continue from this trained folder: keep its VAE (no VAE phase, unless --vae-steps "
                        "is given: then its VAE is trained that many more steps), re-encode the latent pool, and "
                        "train its transformer and text encoder --max-steps more steps")
    parser.add_argument("--lr", type=float, default=None, help=f"denoiser peak learning rate (default {TrainConfig.lr})")
    parser.add_argument("--vae-lr", type=float, default=None, help=f"VAE learning rate (default {TrainConfig.vae_lr})")
    parser.add_argument("--vae-batch-size", type=int, default=None,
                        help=f"clips per VAE step (default {TrainConfig.vae_batch_size})")
    parser.add_argument("--vae-kl-weight", type=float, default=None,
                        help=f"weight of the VAE's KL term (default {TrainConfig.vae_kl_weight})")
    parser.add_argument("--switch-prob", type=float, default=None,
                        help=f"fraction of switch clips (default {TrainConfig.switch_prob})")
    parser.add_argument("--first-frame-prob", type=float, default=None,
                        help=f"fraction of first-frame conditioned denoiser examples (default {TrainConfig.first_frame_prob})")
    parser.add_argument("--clips-per-digit", type=int, default=None,
                        help=f"latent pool clips per training digit (default {TrainConfig.clips_per_digit})")
    parser.add_argument("--tiny", action="store_true",
                        help="tiny architecture, short phases and a small latent pool, for smoke tests")
    training.add_card_argument(parser)
    args = parser.parse_args(argv)
    for flag in ("switch_prob", "first_frame_prob"):
        value = getattr(args, flag)
        if value is not None and not 0.0 <= value <= 1.0:
            parser.error(f"--{flag.replace('_', '-')} must be a fraction in [0, 1], got {value}")
    return args


def main(argv: list[str] | None = None) -> Path:
    """Train and save the pipeline; returns the output folder. See :func:`parse_args`."""
    args = parse_args(argv)
    start, cpu_start = time.monotonic(), time.process_time()
    deadline = start + args.minutes * 60
    size = TINY_SIZE if args.tiny else FULL_SIZE
    tiny = {"vae_steps": 2, "vae_batch_size": 2, "batch_size": 4, "clips_per_digit": 1, "log_every": 1, "max_steps": 2}
    config = training.build_config(
        TrainConfig, args, tiny, vae_steps=args.vae_steps, lr=args.lr, vae_lr=args.vae_lr,
        vae_batch_size=args.vae_batch_size, vae_kl_weight=args.vae_kl_weight, switch_prob=args.switch_prob,
        first_frame_prob=args.first_frame_prob, clips_per_digit=args.clips_per_digit,
    )
    training.seed_everything(config)

    if args.resume is None:
        pipe = build_pipeline(size).to(args.device)
        vae_curve = train_vae(pipe.vae, ClipSampler(config.seed, args.device, config.switch_prob), config, deadline)
    else:
        pipe = WanPipeline.from_pretrained(args.resume).to(args.device)
        vae_curve = []
        if args.vae_steps:  # fine-tune the resumed VAE (e.g. on changed data) before the denoiser
            vae_curve = train_vae(pipe.vae, ClipSampler(config.seed, args.device, config.switch_prob), config, deadline)
    pipe.set_progress_bar_config(disable=True)
    if config.first_frame_prob > 0:  # the transformer takes per-token timesteps (rectified_flow_loss)
        pipe.register_to_config(expand_timesteps=True)
    curve, steps, pool_size = [], 0, 0
    if config.max_steps > 0:  # --max-steps 0: a VAE-only stage (the denoiser stays as initialised)
        latents, specs = encode_latent_pool(pipe.vae, config)
        pool_size = len(latents)
        print(f"latent pool: {tuple(latents.shape)}", flush=True)
        curve, steps = train_denoiser(pipe, latents, specs, config, deadline)

    # diffserve reads per-model sampling defaults from generation_config.json
    out = training.save_pipeline(pipe.to("cpu"), args.out, GENERATION_DEFAULTS)
    wall_s, cpu_s = time.monotonic() - start, time.process_time() - cpu_start

    card_path = training.model_card_path(args.card, out, DEFAULT_WEIGHTS_DIR, PACKAGE_MODEL_CARD)
    params = training.component_parameters(pipe)
    params["total"] = sum(params.values())
    facts = {
        "size": size, "config": config, "params": params, "wall_s": wall_s,
        "command": training.command_line("training.digits_video.train", argv),
        "cpu_s": cpu_s, "steps": steps, "curve": curve, "vae_curve": vae_curve,
        "vae_steps": vae_curve[-1][0] if vae_curve else 0, "resumed_from": args.resume, "pool_size": pool_size, "vocab_size": len(pipe.tokenizer),
        "folder_bytes": folder_bytes(out),
    }
    write_model_card(card_path, facts)
    print(f"saved {out} ({facts['folder_bytes'] / 1e6:.2f} MB, {params['total']:,} parameters) "
          f"in {wall_s:.0f} s wall, {cpu_s:.0f} s CPU; final loss {curve[-1][1] if curve else float('nan'):.4f}; "
          f"card {card_path}")
    print("config:", asdict(config))
    return out


if __name__ == "__main__":
    main()
