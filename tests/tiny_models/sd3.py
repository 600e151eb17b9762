"""Tiny random-weight ``StableDiffusion3Pipeline`` (SD3-medium layout), built offline.

Every component is a real diffusers/transformers class with a small config; tokenizers are
built from in-memory vocabularies (CLIP: the package's byte-level builder), so nothing is
downloaded.
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import (
    AutoencoderKL,
    FlowMatchEulerDiscreteScheduler,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
)
from diffserve.models.digits.tokenizer import build_clip_tokenizer
from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

from .components import t5_tokenizer


def build_tiny_sd3(
    out: Path,
    *,
    with_t5: bool = False,
    clip_max_length: int = 77,
    seed: int = 0,
    num_layers: int = 2,
    sample_size: int = 8,
    num_attention_heads: int = 4,
    attention_head_dim: int = 8,
) -> Path:
    """Build a tiny random-weight `StableDiffusion3Pipeline` and `save_pretrained` it to `out`.

    Latent factor is the real SD3 one: VAE 8x (4 levels) times patch 2 = 16 pixels.
    Default resolution = sample_size * 8 pixels (64 px by default). The transformer's width is
    ``num_attention_heads * attention_head_dim`` (32 by default; benchmarks widen it so a forward
    is compute-bound rather than per-op-overhead-bound).
    """
    torch.manual_seed(seed)
    transformer = SD3Transformer2DModel(
        sample_size=sample_size,
        patch_size=2,
        in_channels=4,
        num_layers=num_layers,
        attention_head_dim=attention_head_dim,
        num_attention_heads=num_attention_heads,
        joint_attention_dim=32,
        caption_projection_dim=num_attention_heads * attention_head_dim,
        pooled_projection_dim=64,
        out_channels=4,
        pos_embed_max_size=32,
    )
    tok = build_clip_tokenizer(clip_max_length)
    clip_cfg = dict(
        hidden_size=32,
        intermediate_size=37,
        num_attention_heads=4,
        num_hidden_layers=2,
        projection_dim=32,
        vocab_size=len(tok),
        max_position_embeddings=clip_max_length,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        hidden_act="gelu",
    )
    # hidden 16 + 16 = 32 = joint_attention_dim; pooled 32 + 32 = 64 = pooled_projection_dim.
    text_encoder = CLIPTextModelWithProjection(CLIPTextConfig(**{**clip_cfg, "hidden_size": 16}))
    text_encoder_2 = CLIPTextModelWithProjection(CLIPTextConfig(**{**clip_cfg, "hidden_size": 16}))
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 8, 8, 8),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=4,
        sample_size=sample_size * 8,
        scaling_factor=1.5,
        shift_factor=0.06,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    text_encoder_3 = tokenizer_3 = None
    if with_t5:
        t5_tok = t5_tokenizer()
        text_encoder_3 = T5EncoderModel(
            T5Config(
                vocab_size=len(t5_tok),
                d_model=32,
                d_ff=37,
                d_kv=8,
                num_layers=2,
                num_heads=4,
                relative_attention_num_buckets=8,
                pad_token_id=0,
                eos_token_id=1,
                decoder_start_token_id=0,
            )
        )
        tokenizer_3 = t5_tok
    pipe = StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tok,
        text_encoder_2=text_encoder_2,
        tokenizer_2=build_clip_tokenizer(clip_max_length),
        text_encoder_3=text_encoder_3,
        tokenizer_3=tokenizer_3,
    )
    out = Path(out)
    pipe.save_pretrained(out)
    return out
