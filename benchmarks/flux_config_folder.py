"""Write a weightless ``FluxPipeline`` folder with FLUX.1-dev's architecture.

Only configs, scheduler settings and offline-built tokenizers are written, no weights, so
``--load-format dummy`` can benchmark the real architecture's cost without downloading anything.
Values are those of the public ``black-forest-labs/FLUX.1-dev`` repository (``model_index.json``,
``transformer/config.json``, ``vae/config.json``, ``scheduler/scheduler_config.json``,
``text_encoder/config.json`` = openai/clip-vit-large-patch14's text tower,
``text_encoder_2/config.json`` = google/t5-v1_1-xxl's encoder), as known to the author:
12B-parameter MMDiT (19 double + 38 single blocks, 24 heads of 128, guidance embedding),
16-channel VAE, CLIP-L (pooled only) and T5-XXL (4096 wide), flow-matching Euler with
resolution-dependent shift. ``tests/test_tiny_models.py`` instantiates every component on the meta
device and checks the parameter counts (FLUX.1-dev: ~11.9B transformer, ~4.76B T5 encoder,
~123M CLIP-L, ~84M VAE).

The tokenizers cannot be the real ones offline (BPE merges / SentencePiece model are
downloads): both are built in memory with the right class and vocabulary size -- a byte-level
``CLIPTokenizer`` with 49408 entries (unused entries fill the vocabulary) and a character unigram
``T5Tokenizer`` (saved as the real folder's ``T5TokenizerFast``) with 32000 pieces + 100 extra ids
= 32100 like T5's. Prompts tokenize into different ids and counts than with the real tokenizers,
but both pipelines pad to fixed lengths (77 and ``max_sequence_length``), so the cost is the
real one. Images from random weights are noise: this folder is for speed and memory only.

Usage:
    python benchmarks/flux_config_folder.py --out /tmp/flux-dev-arch
    python benchmarks/serving.py --model /tmp/flux-dev-arch --load-format dummy --steps 28 --size 1024
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import diffusers
import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
from transformers import CLIPTextConfig, T5Config

from config_folder_tokenizers import clip_tokenizer, t5_tokenizer

TRANSFORMER = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                   num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768,
                   guidance_embeds=True, axes_dims_rope=(16, 56, 56))
VAE = dict(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
           up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(128, 256, 512, 512),
           layers_per_block=2, act_fn="silu", latent_channels=16, norm_num_groups=32, sample_size=1024,
           scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False,
           mid_block_add_attention=True, force_upcast=True)
SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                 base_image_seq_len=256, max_image_seq_len=4096)
CLIP_L = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
              projection_dim=768, hidden_act="quick_gelu", vocab_size=49408, max_position_embeddings=77)
T5_XXL = dict(vocab_size=32128, d_model=4096, d_ff=10240, d_kv=64, num_heads=64, num_layers=24,
              num_decoder_layers=24, feed_forward_proj="gated-gelu", relative_attention_num_buckets=32,
              relative_attention_max_distance=128, layer_norm_epsilon=1e-6, dropout_rate=0.1,
              is_encoder_decoder=True, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
T5_PIECES, T5_EXTRA_IDS = 32000, 100


def write_folder(out: Path) -> Path:
    """Write the folder (configs + tokenizers, ~4 MB) and return its path."""
    out = Path(out)
    with torch.device("meta"):  # build to serialise the configs; no memory is allocated
        FluxTransformer2DModel(**TRANSFORMER).save_config(out / "transformer")
        AutoencoderKL(**VAE).save_config(out / "vae")
    FlowMatchEulerDiscreteScheduler(**SCHEDULER).save_config(out / "scheduler")
    clip = clip_tokenizer()
    clip.save_pretrained(out / "tokenizer")
    clip_config = CLIPTextConfig(**CLIP_L, bos_token_id=clip.bos_token_id, eos_token_id=clip.eos_token_id,
                                 pad_token_id=clip.pad_token_id)
    clip_config.architectures = ["CLIPTextModel"]
    clip_config.save_pretrained(out / "text_encoder")
    t5_tokenizer(T5_PIECES, T5_EXTRA_IDS).save_pretrained(out / "tokenizer_2")
    t5_config = T5Config(**T5_XXL)
    t5_config.tie_word_embeddings = False  # T5 v1.1 unties them (the constructor argument is overridden)
    t5_config.architectures = ["T5EncoderModel"]
    t5_config.save_pretrained(out / "text_encoder_2")
    index = {
        "_class_name": "FluxPipeline",
        "_diffusers_version": diffusers.__version__,
        "feature_extractor": [None, None], "image_encoder": [None, None],
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "CLIPTextModel"],
        "text_encoder_2": ["transformers", "T5EncoderModel"],
        "tokenizer": ["transformers", "CLIPTokenizer"], "tokenizer_2": ["transformers", "T5TokenizerFast"],
        "transformer": ["diffusers", "FluxTransformer2DModel"], "vae": ["diffusers", "AutoencoderKL"],
    }
    (out / "model_index.json").write_text(json.dumps(index, indent=2))
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    print(write_folder(Path(ap.parse_args().out)))
