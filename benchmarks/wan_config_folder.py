"""Write a weightless ``WanPipeline`` folder with Wan 2.1 T2V 1.3B's architecture.

Only configs, scheduler settings and an offline-built tokenizer are written, no weights, so
``--load-format dummy`` can benchmark the real architecture's cost without downloading anything.
Values are those of the public ``Wan-AI/Wan2.1-T2V-1.3B-Diffusers`` repository
(``model_index.json``, ``transformer/config.json``, ``vae/config.json``,
``scheduler/scheduler_config.json``, ``text_encoder/config.json`` = google/umt5-xxl's encoder), as
known to the author (Wan team 2025, arXiv:2503.20314): 1.3B-parameter DiT (30 blocks, 12 heads of
128, FFN 8960, text width 4096, 3-D RoPE, patch (1, 2, 2)), the 3-D causal VAE (8x spatial, 4x
temporal, 16 channels; diffusers' ``AutoencoderKLWan`` defaults are this VAE's config), UMT5-XXL,
and UniPC multistep with flow sigmas (``flow_shift=3.0``). ``tests/test_tiny_models.py``
instantiates every component on the meta device and checks the parameter counts (~1.42B
transformer, ~5.7B UMT5 encoder, ~127M VAE).

The tokenizer cannot be the real one offline (its SentencePiece model is a download): it is a
character unigram ``T5Tokenizer`` (saved as the real folder's ``T5TokenizerFast``) with 256000
pieces + 300 extra ids = 256300 entries like umt5-xxl's (the model's embedding table has 256384
rows). Prompts tokenize into different ids and counts than with the real tokenizer, but Wan pads
to ``max_sequence_length`` (512), so the cost is the real one. Videos from random weights are
noise: this folder is for speed and memory only.

Usage:
    python benchmarks/wan_config_folder.py --out /tmp/wan-1.3b-arch
    python benchmarks/serving.py --model /tmp/wan-1.3b-arch --load-format dummy --steps 50
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import diffusers
import torch
from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel
from transformers import UMT5Config

from config_folder_tokenizers import t5_tokenizer

TRANSFORMER = dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16,
                   out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
                   qk_norm="rms_norm_across_heads", eps=1e-6, image_dim=None, added_kv_proj_dim=None,
                   rope_max_seq_len=1024)
VAE = dict(base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
           temperal_downsample=[False, True, True], dropout=0.0)  # latents_mean/std: the class defaults
SCHEDULER = dict(num_train_timesteps=1000, beta_start=0.0001, beta_end=0.02, beta_schedule="linear",
                 trained_betas=None, solver_order=2, prediction_type="flow_prediction", thresholding=False,
                 dynamic_thresholding_ratio=0.995, sample_max_value=1.0, predict_x0=True, solver_type="bh2",
                 lower_order_final=True, disable_corrector=[], solver_p=None, use_karras_sigmas=False,
                 use_exponential_sigmas=False, use_beta_sigmas=False, use_flow_sigmas=True, flow_shift=3.0,
                 timestep_spacing="linspace", steps_offset=0, final_sigmas_type="zero",
                 rescale_betas_zero_snr=False)
UMT5_XXL = dict(vocab_size=256384, d_model=4096, d_ff=10240, d_kv=64, num_heads=64, num_layers=24,
                num_decoder_layers=24, feed_forward_proj="gated-gelu", relative_attention_num_buckets=32,
                relative_attention_max_distance=128, layer_norm_epsilon=1e-6, dropout_rate=0.1,
                is_encoder_decoder=True, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
UMT5_PIECES, UMT5_EXTRA_IDS = 256000, 300


def write_folder(out: Path) -> Path:
    """Write the folder (configs + tokenizer, ~13 MB, mostly the 256k-entry tokenizer) and return
    its path."""
    out = Path(out)
    with torch.device("meta"):  # build to serialise the configs; no memory is allocated
        WanTransformer3DModel(**TRANSFORMER).save_config(out / "transformer")
        AutoencoderKLWan(**VAE).save_config(out / "vae")
    UniPCMultistepScheduler(**SCHEDULER).save_config(out / "scheduler")
    t5_tokenizer(UMT5_PIECES, UMT5_EXTRA_IDS).save_pretrained(out / "tokenizer")
    config = UMT5Config(**UMT5_XXL)
    config.tie_word_embeddings = False  # umt5-xxl unties them (the constructor argument is overridden)
    config.architectures = ["UMT5EncoderModel"]
    config.save_pretrained(out / "text_encoder")
    index = {
        "_class_name": "WanPipeline",
        "_diffusers_version": diffusers.__version__,
        "boundary_ratio": None, "expand_timesteps": False,
        "scheduler": ["diffusers", "UniPCMultistepScheduler"],
        "text_encoder": ["transformers", "UMT5EncoderModel"],
        "tokenizer": ["transformers", "T5TokenizerFast"],
        "transformer": ["diffusers", "WanTransformer3DModel"], "transformer_2": [None, None],
        "vae": ["diffusers", "AutoencoderKLWan"],
    }
    (out / "model_index.json").write_text(json.dumps(index, indent=2))
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    print(write_folder(Path(ap.parse_args().out)))
