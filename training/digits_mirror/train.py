"""Train the built-in `mirror` LoRA of the digits model: digits drawn mirrored left to right.

Run (from the repository root)::

    python -m training.digits_mirror.train --out diffserve/models/digits/loras/mirror --seed 0

A rank-8 PEFT LoRA (Hu et al. 2021) on every attention and feed-forward linear layer of the
digits model's MMDiT (`SD3Transformer2DModel`), trained with the base model's own objective
(SD3 rectified flow, ``training.digits.train.rectified_flow_loss``) on the model's
training split mirrored left to right, with the base model's prompts (10 % empty, so the
unconditional CFG branch mirrors too). The base weights and text encoders stay frozen; the
result is saved with diffusers' ``StableDiffusion3Pipeline.save_lora_weights`` (its LoRA config
in the safetensors metadata), so diffusers' ``load_lora_weights`` and diffserve's
``--lora mirror`` read the same file.
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

import torch
from diffusers import StableDiffusion3Pipeline
from diffusers.models.attention_processor import JointAttnProcessor2_0
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict

from diffserve.models.digits import DEFAULT_MODEL_PATH
from diffserve.pipelines.sd3.adapter import DEFAULT_MAX_SEQUENCE_LENGTH
from diffserve.pipelines.sd3.context_folding import install_folded_context_attention
from training import common as training
from training.digits import data
from training.digits.train import rectified_flow_loss

#: PEFT target modules: every linear layer of the joint attention and both feed-forwards.
TARGET_MODULES = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
                  "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2"]


def mirrored_latents(pipe: StableDiffusion3Pipeline, images: torch.Tensor) -> torch.Tensor:
    """Scaled VAE latents (posterior means, the model's own shift and scale) of `images`
    (float32 (N, 1, 8, 8) in [-1, 1]) mirrored left to right."""
    vae = pipe.vae
    with torch.no_grad():
        mean = vae.encode(torch.flip(images, dims=[-1])).latent_dist.mean
    return (mean - vae.config.shift_factor) * vae.config.scaling_factor


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="output folder (pytorch_lora_weights.safetensors)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--minutes", type=float, default=90.0, help="wall-clock cap")
    parser.add_argument("--max-steps", type=int, default=1500)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> Path:
    """Train and save the adapter; returns the output folder."""
    args = parse_args(argv)
    start = time.monotonic()
    config = training.TrainConfig(seed=args.seed, threads=args.threads, minutes=args.minutes, batch_size=args.batch_size,
                                  vae_batch_size=args.batch_size, max_steps=args.max_steps, lr=args.lr,
                                  warmup_steps=min(100, max(1, args.max_steps // 10)), weight_decay=0.0)
    training.seed_everything(config)
    pipe = StableDiffusion3Pipeline.from_pretrained(DEFAULT_MODEL_PATH, text_encoder_3=None, tokenizer_3=None)
    pipe.set_progress_bar_config(disable=True)
    for module in (pipe.transformer, pipe.text_encoder, pipe.text_encoder_2, pipe.vae):
        module.requires_grad_(False)
    images, labels = data.train_tensors()
    latents = mirrored_latents(pipe, images)

    lora = LoraConfig(r=args.rank, lora_alpha=args.rank, target_modules=TARGET_MODULES, init_lora_weights=True)
    pipe.transformer.add_adapter(lora)
    trainable = torch.nn.ParameterList([p for n, p in pipe.transformer.named_parameters() if "lora_" in n])
    for p in trainable:
        p.requires_grad_(True)

    def batch_loss(idx, prompt_rng, generator):
        prompts = data.sample_training_prompts(labels[idx].tolist(), prompt_rng, config.empty_prompt_prob)
        return rectified_flow_loss(pipe, latents[idx], prompts, generator)

    install_folded_context_attention(pipe.transformer, DEFAULT_MAX_SEQUENCE_LENGTH)
    curve, steps = training.train_denoiser([trainable], len(latents), batch_loss, config,
                                           start + args.minutes * 60)
    pipe.transformer.set_attn_processor(JointAttnProcessor2_0())

    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    StableDiffusion3Pipeline.save_lora_weights(
        out, transformer_lora_layers=get_peft_model_state_dict(pipe.transformer),
        transformer_lora_adapter_metadata=lora.to_dict())
    wall_s = time.monotonic() - start
    print(f"saved {out} in {wall_s:.0f} s: {steps} steps, rank {args.rank}, "
          f"{sum(p.numel() for p in trainable):,} trainable parameters, {args.threads} thread(s), "
          f"{platform.processor() or platform.machine()}, torch {torch.__version__}")
    print(training.loss_table(curve))
    return out


if __name__ == "__main__":
    main()
