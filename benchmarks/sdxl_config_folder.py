"""Write a weightless ``StableDiffusionXLPipeline`` folder with SDXL base 1.0's architecture.

Only configs, scheduler settings and offline-built tokenizers are written, no weights, so
``--load-format dummy`` can benchmark the real architecture's cost without downloading anything.
Values are those of the public ``stabilityai/stable-diffusion-xl-base-1.0`` repository
(``model_index.json`` with ``force_zeros_for_empty_prompt: true``, ``unet/config.json``,
``vae/config.json``, ``scheduler/scheduler_config.json``, ``text_encoder/config.json`` = CLIP
ViT-L/14's text tower, ``text_encoder_2/config.json`` = OpenCLIP ViT-bigG/14's text tower with
projection), as known to the author (Podell et al. 2023, arXiv:2307.01952): 2.6B-parameter UNet
(3 levels 320/640/1280, 1/2/10 transformer blocks, cross-attention 2048 = 768 + 1280,
``text_time`` addition embedding 2816 = 1280 + 6 x 256), Euler with leading spacing.
``tests/test_tiny_models.py`` instantiates every component on the meta device and checks the
parameter counts (~2.57B UNet, ~695M CLIP-G, ~123M CLIP-L, ~84M VAE).

The tokenizers cannot be the real ones offline (the BPE merges are a download): both are the
package's byte-level ``CLIPTokenizer`` with the vocabulary filled up to CLIP's 49408 entries.
Prompts tokenize into different ids than with the real tokenizers (and tokenizer_2 pads with
``<|endoftext|>``, the real one with ``!``), but SDXL pads to 77 tokens, so the cost is the real
one. Images from random weights are noise: this folder is for speed and memory only.

Usage:
    python benchmarks/sdxl_config_folder.py --out /tmp/sdxl-arch
    python benchmarks/serving.py --model /tmp/sdxl-arch --load-format dummy --steps 30 --size 1024
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import diffusers
import torch
from diffusers import AutoencoderKL, EulerDiscreteScheduler, UNet2DConditionModel
from transformers import CLIPTextConfig

from config_folder_tokenizers import clip_tokenizer

UNET = dict(sample_size=128, in_channels=4, out_channels=4, center_input_sample=False, flip_sin_to_cos=True,
            freq_shift=0, down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
            mid_block_type="UNetMidBlock2DCrossAttn",
            up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
            block_out_channels=(320, 640, 1280), layers_per_block=2, downsample_padding=1,
            mid_block_scale_factor=1, act_fn="silu", norm_num_groups=32, norm_eps=1e-5, cross_attention_dim=2048,
            transformer_layers_per_block=(1, 2, 10), attention_head_dim=(5, 10, 20), use_linear_projection=True,
            addition_embed_type="text_time", addition_time_embed_dim=256,
            projection_class_embeddings_input_dim=2816, upcast_attention=False)
VAE = dict(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
           up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(128, 256, 512, 512),
           layers_per_block=2, act_fn="silu", latent_channels=4, norm_num_groups=32, sample_size=1024,
           scaling_factor=0.13025, force_upcast=True)
SCHEDULER = dict(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                 prediction_type="epsilon", interpolation_type="linear", timestep_spacing="leading", steps_offset=1,
                 use_karras_sigmas=False, trained_betas=None)
CLIP_L = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
              projection_dim=768, hidden_act="quick_gelu")
CLIP_G = dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=20,
              projection_dim=1280, hidden_act="gelu")


def write_folder(out: Path) -> Path:
    """Write the folder (configs + tokenizers, ~3 MB) and return its path."""
    out = Path(out)
    with torch.device("meta"):  # build to serialise the configs; no memory is allocated
        UNet2DConditionModel(**UNET).save_config(out / "unet")
        AutoencoderKL(**VAE).save_config(out / "vae")
    EulerDiscreteScheduler(**SCHEDULER).save_config(out / "scheduler")
    for i, cfg, architecture in (("", CLIP_L, "CLIPTextModel"), ("_2", CLIP_G, "CLIPTextModelWithProjection")):
        tokenizer = clip_tokenizer()
        tokenizer.save_pretrained(out / f"tokenizer{i}")
        config = CLIPTextConfig(**cfg, vocab_size=49408, max_position_embeddings=77,
                                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                pad_token_id=tokenizer.pad_token_id)
        config.architectures = [architecture]
        config.save_pretrained(out / f"text_encoder{i}")
    index = {
        "_class_name": "StableDiffusionXLPipeline",
        "_diffusers_version": diffusers.__version__,
        "force_zeros_for_empty_prompt": True,
        "feature_extractor": [None, None], "image_encoder": [None, None],
        "scheduler": ["diffusers", "EulerDiscreteScheduler"],
        "text_encoder": ["transformers", "CLIPTextModel"],
        "text_encoder_2": ["transformers", "CLIPTextModelWithProjection"],
        "tokenizer": ["transformers", "CLIPTokenizer"], "tokenizer_2": ["transformers", "CLIPTokenizer"],
        "unet": ["diffusers", "UNet2DConditionModel"], "vae": ["diffusers", "AutoencoderKL"],
    }
    (out / "model_index.json").write_text(json.dumps(index, indent=2))
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    print(write_folder(Path(ap.parse_args().out)))
