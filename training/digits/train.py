"""Train diffserve's built-in text-to-image digits model (a tiny Stable Diffusion 3 pipeline).

Run::

    python -m training.digits.train --out diffserve/models/digits/weights --seed 0

The result is a standard diffusers ``StableDiffusion3Pipeline`` folder built only from
diffusers' and transformers' own classes, so ``StableDiffusion3Pipeline.from_pretrained(out)``
loads it with no diffserve code, and ``pipe(prompt, height=8, width=8)`` with the pipeline's
default arguments produces an 8x8 grayscale digit.

Components (all randomly initialised, trained here on CPU):

* ``AutoencoderKL`` with one level (``vae_scale_factor == 1``) and one latent channel, trained
  first to reconstruct the digits; its ``shift_factor``/``scaling_factor`` are set so the
  scaled latents have zero mean and unit variance.
* Two ``CLIPTextModelWithProjection`` encoders with the offline tokenizers of
  :mod:`diffserve.models.digits.tokenizer`; no T5 (``text_encoder_3 = None``).
* ``SD3Transformer2DModel`` (MMDiT, Esser et al. 2024, arXiv:2403.03206) trained jointly with
  both text encoders by rectified flow: ``x_t = (1 - t) x0 + t noise``, ``t`` logit-normal(0, 1),
  the transformer gets ``timestep = 1000 t`` and regresses ``noise - x0``. 10 % of captions are
  replaced by ``""`` (the pipeline's default negative prompt) for classifier-free guidance.
* ``FlowMatchEulerDiscreteScheduler(shift=1.0)``.

Text conditioning during training is computed by the pipeline's own ``encode_prompt`` with its
default arguments, exactly as at inference. With no T5, that appends ``max_sequence_length``
(256) all-zero rows after the 16 CLIP rows. Those rows are identical at every layer of the
MMDiT (all its context-side operations are per-token), so to train ~8x faster they are
collapsed into ONE row whose attention logit gets ``+log(256)``
(`diffserve.pipelines.sd3.context_folding`, which diffserve also uses to serve the model):
mathematically the same function as attending to 256
copies. ``tests/models/test_digits.py`` checks both forwards agree.
"""

from __future__ import annotations

import argparse
import platform
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from diffusers import (
    AutoencoderKL,
    FlowMatchEulerDiscreteScheduler,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
)
from diffusers.models.attention_processor import JointAttnProcessor2_0
from transformers import CLIPTextConfig, CLIPTextModelWithProjection

from training import common as training
from training.digits import data
from training.common import QUALITY_BEGIN, QUALITY_END, folder_bytes, loss_table
from diffserve.pipelines.sd3.context_folding import fold_placeholder_rows, install_folded_context_attention
from diffserve.pipelines.sd3.adapter import DEFAULT_MAX_SEQUENCE_LENGTH
from diffserve.models.digits import DEFAULT_MODEL_PATH
from diffserve.models.digits.tokenizer import (
    MODEL_MAX_LENGTH,
    VOCABULARY_WORDS,
    build_clip_tokenizer,
)

#: Folder of the shipped default model (``diffserve.models.digits.DEFAULT_MODEL_PATH``) and its package.
PACKAGE_DIR = DEFAULT_MODEL_PATH.parent
DEFAULT_WEIGHTS_DIR = PACKAGE_DIR / "weights"
PACKAGE_MODEL_CARD = PACKAGE_DIR / "MODEL_CARD.md"
#: Sampling defaults shipped with the model: the settings its judge accuracy is reported at.
GENERATION_DEFAULTS = {"num_inference_steps": 20, "guidance_scale": 4.0, "height": 8, "width": 8}


@dataclass(frozen=True)
class ModelSize:
    """Architecture hyper-parameters of the pipeline's components."""

    text_hidden: int = 32
    text_layers: int = 2
    text_heads: int = 2
    text_intermediate: int = 64
    text_projection: int = 32
    transformer_layers: int = 4
    transformer_heads: int = 3
    transformer_head_dim: int = 32
    vae_channels: int = 32
    vae_groups: int = 8


FULL_SIZE = ModelSize()
TINY_SIZE = ModelSize(
    text_hidden=8, text_layers=2, text_heads=1, text_intermediate=16, text_projection=8,
    transformer_layers=1, transformer_heads=1, transformer_head_dim=8, vae_channels=8, vae_groups=4,
)


@dataclass(frozen=True, kw_only=True)
class TrainConfig(training.TrainConfig):
    """Optimisation settings; the defaults are the ones used for the shipped model."""

    minutes: float = 20.0
    batch_size: int = 128
    vae_batch_size: int = 128


def build_pipeline(size: ModelSize = FULL_SIZE) -> StableDiffusion3Pipeline:
    """Build an untrained SD3 pipeline for 8x8 one-channel images (uses the global torch RNG).

    Returns:
        ``StableDiffusion3Pipeline`` on CPU, float32, with ``text_encoder_3 = tokenizer_3 = None``.
        The transformer sees a (B, 1, 8, 8) latent as 4x4 = 16 patches of 2x2.
    """
    tokenizer = build_clip_tokenizer()
    tokenizer_2 = build_clip_tokenizer()

    def text_encoder() -> CLIPTextModelWithProjection:
        config = CLIPTextConfig(
            vocab_size=len(tokenizer),
            hidden_size=size.text_hidden,
            intermediate_size=size.text_intermediate,
            num_hidden_layers=size.text_layers,
            num_attention_heads=size.text_heads,
            projection_dim=size.text_projection,
            max_position_embeddings=MODEL_MAX_LENGTH,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        return CLIPTextModelWithProjection(config)

    transformer = SD3Transformer2DModel(
        sample_size=data.IMAGE_SIZE,
        patch_size=2,
        in_channels=1,
        out_channels=1,
        num_layers=size.transformer_layers,
        attention_head_dim=size.transformer_head_dim,
        num_attention_heads=size.transformer_heads,
        joint_attention_dim=2 * size.text_hidden,
        caption_projection_dim=size.transformer_heads * size.transformer_head_dim,
        pooled_projection_dim=2 * size.text_projection,
        pos_embed_max_size=data.IMAGE_SIZE // 2,
    )
    vae = AutoencoderKL(
        in_channels=1,
        out_channels=1,
        down_block_types=("DownEncoderBlock2D",),
        up_block_types=("UpDecoderBlock2D",),
        block_out_channels=(size.vae_channels,),
        layers_per_block=1,
        latent_channels=1,
        norm_num_groups=size.vae_groups,
        sample_size=data.IMAGE_SIZE,
        shift_factor=0.0,
        scaling_factor=1.0,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )
    return StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=1.0),
        vae=vae,
        text_encoder=text_encoder(),
        tokenizer=tokenizer,
        text_encoder_2=text_encoder(),
        tokenizer_2=tokenizer_2,
        text_encoder_3=None,
        tokenizer_3=None,
    )


def train_vae(
    vae: AutoencoderKL, images: torch.Tensor, config: TrainConfig, deadline: float
) -> list[tuple[int, float]]:
    """Train ``vae`` in place to reconstruct ``images`` (float32 (N, 1, 8, 8) in [-1, 1]).

    Loss: mean squared error of the reconstruction from a posterior sample plus
    ``config.vae_kl_weight`` times the per-element mean KL to N(0, 1) (Kingma & Welling 2014),
    on batches of ``config.vae_batch_size`` images drawn with replacement (global torch RNG).
    Adam with cosine learning-rate decay (:func:`training.common.train_vae`); stops
    early at ``deadline`` (``time.monotonic()``).

    Returns:
        ``(step, mean loss over the last log interval)`` pairs.
    """

    def batch_loss() -> torch.Tensor:
        batch = images[torch.randint(len(images), (config.vae_batch_size,))]
        posterior = vae.encode(batch).latent_dist
        recon = vae.decode(posterior.sample()).sample
        return F.mse_loss(recon, batch) + config.vae_kl_weight * posterior.kl().mean() / batch[0].numel()

    return training.train_vae(vae, batch_loss, config, deadline)


@torch.no_grad()
def normalize_latents(vae: AutoencoderKL, images: torch.Tensor) -> torch.Tensor:
    """Set ``vae.config.shift_factor``/``scaling_factor`` from the posterior means of ``images``.

    Args:
        images: float32 (N, 1, 8, 8) in [-1, 1].

    Returns:
        float32 (N, 1, 8, 8) scaled latents ``(mean - shift) * scale`` (zero mean, unit variance),
        the ``x0`` of the diffusion objective; the pipeline inverts it as
        ``latents / scaling_factor + shift_factor`` before decoding.
    """
    latents = vae.encode(images).latent_dist.mean
    shift = latents.mean().item()
    scale = 1.0 / latents.std().item()
    vae.register_to_config(shift_factor=shift, scaling_factor=scale)
    return (latents - shift) * scale


def rectified_flow_loss(
    pipe: StableDiffusion3Pipeline,
    x0: torch.Tensor,
    prompts: list[str],
    generator: torch.Generator,
    collapse: bool = True,
) -> torch.Tensor:
    """SD3 rectified-flow loss (Esser et al. 2024, arXiv:2403.03206, sections 2-3).

    Args:
        x0: float32 (B, 1, 8, 8) scaled VAE latents.
        prompts: B prompts, encoded by ``pipe.encode_prompt`` with its default arguments.
        generator: CPU generator for ``t`` and the noise.
        collapse: fold the zero placeholder rows into one (requires the transformer to use
            `FoldedContextAttnProcessor`); ``False`` runs the stock full-length forward.

    Returns:
        Scalar mean squared error between the transformer output and ``noise - x0`` at
        ``x_t = (1 - t) x0 + t noise``, ``t = sigmoid(N(0, 1))``, ``timestep = 1000 t``.
    """
    prompt_embeds, _, pooled, _ = pipe.encode_prompt(
        prompt=prompts, prompt_2=None, prompt_3=None, do_classifier_free_guidance=False
    )
    t = torch.sigmoid(torch.randn(len(x0), generator=generator))
    noise = torch.randn(x0.shape, generator=generator)
    x_t = (1 - t.view(-1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1) * noise
    if collapse:
        prompt_embeds = fold_placeholder_rows(prompt_embeds, pipe.tokenizer_max_length)
    pred = pipe.transformer(
        hidden_states=x_t,
        timestep=t * 1000,
        encoder_hidden_states=prompt_embeds,
        pooled_projections=pooled,
        return_dict=False,
    )[0]
    return F.mse_loss(pred, noise - x0)


def train_denoiser(
    pipe: StableDiffusion3Pipeline,
    latents: torch.Tensor,
    labels: torch.Tensor,
    config: TrainConfig,
    deadline: float,
) -> tuple[list[tuple[int, float]], int]:
    """Train the transformer and both text encoders jointly; leaves their EMA weights in ``pipe``.

    The loop (AdamW, warm-up then cosine decay, EMA, deadline) is
    :func:`training.common.train_denoiser`; the loss is :func:`rectified_flow_loss` with
    the zero context rows folded, on prompts from ``data.sample_training_prompts``.

    Args:
        latents: float32 (N, 1, 8, 8) scaled latents of the training images.
        labels: int64 (N,) digits.

    Returns:
        ``(loss curve as (step, mean loss of the interval) pairs, steps done)``.
    """
    modules = [pipe.transformer, pipe.text_encoder, pipe.text_encoder_2]

    def batch_loss(idx: torch.Tensor, prompt_rng: random.Random, generator: torch.Generator) -> torch.Tensor:
        prompts = data.sample_training_prompts(labels[idx].tolist(), prompt_rng, config.empty_prompt_prob)
        return rectified_flow_loss(pipe, latents[idx], prompts, generator)

    install_folded_context_attention(pipe.transformer, DEFAULT_MAX_SEQUENCE_LENGTH)
    curve, steps = training.train_denoiser(modules, len(latents), batch_loss, config, deadline)
    pipe.transformer.set_attn_processor(JointAttnProcessor2_0())
    return curve, steps


def write_model_card(path: Path, facts: dict) -> None:
    """Write the model card (markdown) to ``path`` from the facts gathered by :func:`main`.

    The judge section (between ``QUALITY_BEGIN``/``QUALITY_END``) is left empty: it is filled in
    by ``benchmarks/quality.py --update-card``, and a fresh training run resets it since old
    numbers would describe other weights.
    """
    size: ModelSize = facts["size"]
    config: TrainConfig = facts["config"]
    vocab = ", ".join(f"`{w}`" for w in VOCABULARY_WORDS)
    train_templates = "\n".join(f"- `{t}`" for t in data.TRAIN_TEMPLATES)
    heldout_templates = "\n".join(f"- `{t}`" for t in data.HELDOUT_TEMPLATES)
    card = f"""# diffserve built-in model: `digits` (text-to-image, 8x8 grayscale)

A tiny Stable Diffusion 3 pipeline trained from scratch on scikit-learn's bundled handwritten
digits (`sklearn.datasets.load_digits`, 1797 images of 8x8 pixels, intensities 0..16). It is
diffserve's default model: small enough to ship in the package and run on a CPU in tests, while
exercising the real SD3 code path (two CLIP text encoders, MMDiT transformer, KL autoencoder,
flow-matching Euler scheduler).

```python
from diffusers import StableDiffusion3Pipeline
from diffserve.models.digits import DEFAULT_MODEL_PATH
# diffusers 0.42.1 needs the absent T5 slots passed explicitly (model_index.json has them as null)
pipe = StableDiffusion3Pipeline.from_pretrained(DEFAULT_MODEL_PATH, text_encoder_3=None, tokenizer_3=None)
image = pipe("a handwritten digit 7").images[0]  # 8x8 grayscale PIL image, default arguments
```

The pipeline's default size is already 8x8 (`transformer.sample_size` 8 x `vae_scale_factor` 1);
other sizes are outside the training distribution. Pixels: black background (0), white strokes (1).

## Architecture

| component | class | config | parameters |
|---|---|---|---:|
| transformer | `SD3Transformer2DModel` | {size.transformer_layers} layers, {size.transformer_heads} heads x {size.transformer_head_dim}, patch 2, `pos_embed_max_size` 4, joint_attention_dim {2 * size.text_hidden} | {facts["params"]["transformer"]:,} |
| text_encoder, text_encoder_2 | `CLIPTextModelWithProjection` | {size.text_layers} layers, hidden {size.text_hidden}, {size.text_heads} heads, projection {size.text_projection}, 16 positions | {facts["params"]["text_encoder"]:,} each |
| vae | `AutoencoderKL` | one level ({size.vae_channels} channels), 1 latent channel, `vae_scale_factor` 1, shift_factor {facts["shift"]:.4f}, scaling_factor {facts["scale"]:.4f} | {facts["params"]["vae"]:,} |
| scheduler | `FlowMatchEulerDiscreteScheduler` | shift 1.0 | - |
| tokenizer, tokenizer_2 | `CLIPTokenizer` | byte-level BPE, {facts["vocab_size"]} tokens, `model_max_length` {MODEL_MAX_LENGTH} | - |
| text_encoder_3, tokenizer_3 | none | no T5: the pipeline feeds 256 zero rows in its place | - |

Total parameters: {facts["params"]["total"]:,}. Folder size: {facts["folder_bytes"] / 1e6:.2f} MB (safetensors).

The latent is 8x8x1 (4x4 = 16 transformer tokens); the transformer attends jointly over 16 image
tokens, 16 CLIP tokens and 256 zero "T5" tokens (pipeline default `max_sequence_length=256`).

## Training

Command (wall time {facts["wall_s"] / 60:.1f} min on {config.threads} CPU thread(s), {platform.processor() or platform.machine()},
torch {torch.__version__}, seed {config.seed}):

```
{facts["command"]}
```

- Data: the fixed stratified 80/20 split of `load_digits` (`train_test_split(test_size=0.2,
  stratify=y, random_state=0)`): 1437 training images; the 360 held-out images are never trained on.
  Images scaled to [-1, 1].
- VAE: {facts["vae_steps"]} Adam steps (lr {config.vae_lr}, batch {config.vae_batch_size}), MSE + {config.vae_kl_weight} x KL;
  final loss {facts["vae_curve"][-1][1]:.5f}. Latents = posterior means, shifted/scaled to zero mean, unit variance.
- Denoiser: rectified flow as in SD3 (Esser et al. 2024): `x_t = (1-t) x0 + t noise`, `t ~ logit-normal(0, 1)`,
  `timestep = 1000 t`, target `noise - x0`; transformer and both text encoders trained jointly from scratch.
  {facts["steps"]} AdamW steps (lr {config.lr}, weight decay {config.weight_decay}, batch {config.batch_size},
  {config.warmup_steps} warm-up steps then cosine), gradient clipping 1.0, EMA {config.ema_decay} (the shipped weights are the EMA).
- Prompts: a random training template per image; `""` with probability {config.empty_prompt_prob} (classifier-free guidance;
  `""` is the pipeline's default negative prompt). Conditioning is computed by the pipeline's own
  `encode_prompt` with default arguments; the 256 identical zero rows are collapsed into one row
  with attention logit `+log 256` (an exact identity, checked in `tests/models/test_digits.py`),
  which makes training ~8x faster; diffserve serves the model the same way
  (`diffserve.pipelines.sd3.context_folding`), the saved weights work unchanged in diffusers.

### Loss curve (denoiser)

{loss_table(facts["curve"])}

## Quality (judge)

{QUALITY_BEGIN}
Not measured yet for these weights. Run `python benchmarks/quality.py --update-card`.
{QUALITY_END}

## Prompts and vocabulary

Whole-word tokens: {vocab}. Any other text still tokenizes (byte-level pieces, never the unknown
token), but the model has never seen it; `diffserve.models.digits.out_of_vocabulary_words(prompt)`
lists such words. Prompts longer than {MODEL_MAX_LENGTH} tokens (BOS and EOS included) are truncated.

Training templates (`{{d}}` = digit, `{{word}}` = its name):

{train_templates}

Held-out templates (never used in training; all their words are):

{heldout_templates}

## Limitations

- 8x8 grayscale only; other sizes are outside the training distribution (sizes must be even).
- Knows only the ten digits; prompts about anything else give an arbitrary digit or a blur.
- The prompt's wording selects the digit, not the style: for a fixed seed, different templates for
  the same digit give nearly the same image.
- Trained on 1437 images: samples stay close to the training set (see novelty in the judge section).
- The quality judge is an RBF SVM on the same training split; it is a proxy for legibility, not for
  human judgement.
"""
    path.write_text(card)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line arguments (see module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    training.add_run_arguments(parser, TrainConfig)
    parser.add_argument("--max-steps", type=int, default=None,
                        help=f"denoiser steps (default {TrainConfig.max_steps}); also sets the LR schedule")
    parser.add_argument("--threads", type=int, default=TrainConfig.threads, help="torch.set_num_threads")
    parser.add_argument("--tiny", action="store_true",
                        help="tiny architecture and short VAE phase, for smoke tests")
    training.add_card_argument(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> Path:
    """Train and save the pipeline; returns the output folder. See :func:`parse_args`."""
    args = parse_args(argv)
    start = time.monotonic()
    deadline = start + args.minutes * 60
    size = TINY_SIZE if args.tiny else FULL_SIZE
    tiny = {"vae_steps": min(TrainConfig.vae_steps, 3), "batch_size": 16, "vae_batch_size": 16, "log_every": 1}
    config = training.build_config(TrainConfig, args, tiny)
    training.seed_everything(config)

    pipe = build_pipeline(size)
    pipe.set_progress_bar_config(disable=True)
    images, labels = data.train_tensors()

    vae_curve = train_vae(pipe.vae, images, config, deadline)
    latents = normalize_latents(pipe.vae, images)
    curve, steps = train_denoiser(pipe, latents, labels, config, deadline)

    # diffserve reads per-model sampling defaults from generation_config.json (pipelines/sd3.py)
    out = training.save_pipeline(pipe, args.out, GENERATION_DEFAULTS)
    wall_s = time.monotonic() - start

    card_path = training.model_card_path(args.card, out, DEFAULT_WEIGHTS_DIR, PACKAGE_MODEL_CARD)
    params = training.component_parameters(pipe)
    params["total"] = params["transformer"] + 2 * params["text_encoder"] + params["vae"]
    facts = {
        "size": size, "config": config, "params": params, "wall_s": wall_s,
        "command": training.command_line("training.digits.train", argv),
        "steps": steps, "curve": curve, "vae_curve": vae_curve, "vae_steps": vae_curve[-1][0],
        "shift": pipe.vae.config.shift_factor, "scale": pipe.vae.config.scaling_factor,
        "vocab_size": len(pipe.tokenizer), "folder_bytes": folder_bytes(out),
    }
    write_model_card(card_path, facts)
    print(f"saved {out} ({facts['folder_bytes'] / 1e6:.2f} MB, {params['total']:,} parameters) "
          f"in {wall_s:.0f} s; final loss {curve[-1][1]:.4f}; card {card_path}")
    print("config:", asdict(config))
    return out


if __name__ == "__main__":
    main()
