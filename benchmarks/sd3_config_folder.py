"""Write a weightless `StableDiffusion3Pipeline` folder with SD3-medium's architecture.

Only configs, scheduler settings and (offline-built, byte-level) CLIP tokenizers are written,
no weights, so `--load-format dummy` can benchmark the real architecture's cost without
downloading anything. The transformer, CLIP-L/CLIP-G text encoders and the 16-channel VAE use
the published SD3-medium configurations (Esser et al. 2024, arXiv:2403.03206); T5 is left out
(`text_encoder_3` null, as diffusers allows). Images from random weights are noise: this
folder is for speed and memory only.

Usage:
    python benchmarks/sd3_config_folder.py --out /tmp/sd3-medium-arch
    python benchmarks/serving.py --model /tmp/sd3-medium-arch --load-format dummy --steps 28 \
        --guidance 7 --size 512 --concurrency 16
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import diffusers
import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
from transformers import CLIPTextConfig

from diffserve.models.digits.tokenizer import build_clip_tokenizer

TRANSFORMER = dict(sample_size=128, patch_size=2, in_channels=16, num_layers=24, attention_head_dim=64,
                   num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536,
                   pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=192)
VAE = dict(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
           up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(128, 256, 512, 512),
           layers_per_block=2, latent_channels=16, norm_num_groups=32, sample_size=1024,
           scaling_factor=1.5305, shift_factor=0.0609, use_quant_conv=False, use_post_quant_conv=False)
CLIP_L = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
              projection_dim=768, hidden_act="quick_gelu")
CLIP_G = dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=20,
              projection_dim=1280, hidden_act="gelu")


def write_folder(out: Path) -> Path:
    """Write the folder (configs + tokenizers, ~1 MB) and return its path."""
    out = Path(out)
    with torch.device("meta"):  # build to serialise the configs; no memory is allocated
        SD3Transformer2DModel(**TRANSFORMER).save_config(out / "transformer")
        AutoencoderKL(**VAE).save_config(out / "vae")
    FlowMatchEulerDiscreteScheduler(shift=3.0).save_config(out / "scheduler")
    for i, cfg in (("", CLIP_L), ("_2", CLIP_G)):
        tokenizer = build_clip_tokenizer(model_max_length=77)
        tokenizer.save_pretrained(out / f"tokenizer{i}")
        config = CLIPTextConfig(**cfg, vocab_size=49408, max_position_embeddings=77,
                                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                pad_token_id=tokenizer.pad_token_id)
        config.architectures = ["CLIPTextModelWithProjection"]
        config.save_pretrained(out / f"text_encoder{i}")
    index = {
        "_class_name": "StableDiffusion3Pipeline",
        "_diffusers_version": diffusers.__version__,
        "feature_extractor": [None, None], "image_encoder": [None, None],
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "CLIPTextModelWithProjection"],
        "text_encoder_2": ["transformers", "CLIPTextModelWithProjection"],
        "text_encoder_3": [None, None],
        "tokenizer": ["transformers", "CLIPTokenizer"], "tokenizer_2": ["transformers", "CLIPTokenizer"],
        "tokenizer_3": [None, None],
        "transformer": ["diffusers", "SD3Transformer2DModel"], "vae": ["diffusers", "AutoencoderKL"],
    }
    (out / "model_index.json").write_text(json.dumps(index, indent=2))
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    print(write_folder(Path(ap.parse_args().out)))
