"""Tiny GLM-Image (`GlmImagePipeline`, diffusers 0.42): an AR model that writes prior image
tokens and a DiT that renders them.

Components (random weights, offline):

* ``vision_language_encoder``: `GlmImageForConditionalGeneration` (2 text layers of hidden 32,
  M-RoPE sections (4, 2, 2); a 2-layer vision tower and a 32-code VQ model it never uses for
  text-to-image). Its LM head has ``vision_vocab_size`` = 128 outputs: the image-token ids 0..127
  it samples. Token ids: 0..127 image codes, then the processor's special tokens, then 256
  byte-level text symbols.
* ``processor``: `GlmImageProcessor` = a byte-level BPE tokenizer (no merges) whose extra special
  tokens are GLM's ``image_token`` / ``grid_bos_token`` (``<sop>``) / ``grid_eos_token``
  (``<eop>``), BOS = the image-start token, plus GLM's PIL image processor and a minimal chat
  template (the user's text).
* ``tokenizer`` / ``text_encoder``: ByT5 (byte-level, no vocabulary file) and a 2-layer
  `T5EncoderModel` of hidden 32: the glyph encoder for quoted text.
* ``transformer``: `GlmImageTransformer2DModel` (2 layers, 2 heads x 8, patch 2, codebook 128).
* ``vae``: `AutoencoderKL` with 8x down-sampling (4 levels), 4 latent channels, latents_mean 0 /
  latents_std 1; ``scheduler``: `FlowMatchEulerDiscreteScheduler`.

diffusers' ``__call__`` behaviour that matters for parity: the AR stage samples
(``do_sample=True``) after ``torch.manual_seed(generator.initial_seed())`` and generates
``h/32 * w/32 + prev_h * prev_w + 1`` tokens (prev: a 16x16-ish preview grid, 256 tokens at a
square size); the DiT reads the large grid's tokens upsampled 2x; timesteps are
``linspace(1000, 1, steps + 1)[:-1]`` shifted with ``mu`` (``calculate_shift``, base 0.25, max
0.75), the DiT gets ``timestep - 1``; CFG (``guidance_scale`` 1.5 > 1) runs an unconditional branch
with the prior tokens dropped and the glyph embeddings of ``""``; sizes are multiples of 32.
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, GlmImagePipeline, GlmImageTransformer2DModel
from tokenizers import Tokenizer, decoders, pre_tokenizers
from tokenizers.models import BPE
from transformers import (
    ByT5Tokenizer,
    GlmImageConfig,
    GlmImageForConditionalGeneration,
    GlmImageProcessor,
    PreTrainedTokenizerFast,
    T5Config,
    T5EncoderModel,
)
from transformers.models.glm_image.image_processing_pil_glm_image import GlmImageImageProcessorPil

#: Image codes the AR model writes (its LM head's outputs) and the DiT's codebook.
CODEBOOK = 128
SPECIAL = {"pad": "<|pad|>", "image_start": "<|begin_of_image|>", "image_end": "<|end_of_image|>",
           "image": "<|image|>", "grid_bos": "<sop>", "grid_eos": "<eop>", "user": "<|user|>"}
CHAT_TEMPLATE = (
    "{% for message in messages %}<|user|>\n{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}<|begin_of_image|><|image|><|end_of_image|>"
    "{% else %}{{ item['text'] }}{% endif %}{% endfor %}{% endfor %}"
)


def glm_processor() -> GlmImageProcessor:
    """The offline processor (see the module docstring); token ids are fixed by construction."""
    vocab = {f"<|code_{i}|>": i for i in range(CODEBOOK)}
    for token in SPECIAL.values():
        vocab[token] = len(vocab)
    for symbol in pre_tokenizers.ByteLevel.alphabet():
        vocab[symbol] = len(vocab)
    backend = Tokenizer(BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=SPECIAL["image_start"], eos_token=SPECIAL["image_end"],
        pad_token=SPECIAL["pad"], padding_side="left",
        extra_special_tokens={"image_token": SPECIAL["image"], "grid_bos_token": SPECIAL["grid_bos"],
                              "grid_eos_token": SPECIAL["grid_eos"]},
    )
    tokenizer.add_special_tokens({"additional_special_tokens": [SPECIAL["user"]]}, replace_extra_special_tokens=False)
    image_processor = GlmImageImageProcessorPil(patch_size=8, temporal_patch_size=1, merge_size=1)
    return GlmImageProcessor(image_processor=image_processor, tokenizer=tokenizer, chat_template=CHAT_TEMPLATE)


def glm_components(seed: int = 0) -> dict:
    """Every component of a tiny `GlmImagePipeline` (seeded)."""
    processor = glm_processor()
    tok = processor.tokenizer
    ids = {name: tok.convert_tokens_to_ids(token) for name, token in SPECIAL.items()}
    torch.manual_seed(seed)
    byt5 = ByT5Tokenizer()
    text_encoder = T5EncoderModel(T5Config(vocab_size=len(byt5), d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                           num_heads=4, relative_attention_num_buckets=8, pad_token_id=0,
                                           eos_token_id=1, decoder_start_token_id=0))
    config = GlmImageConfig(
        text_config={"vocab_size": len(tok), "hidden_size": 32, "intermediate_size": 32, "num_hidden_layers": 2,
                     "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 1024,
                     "vision_vocab_size": CODEBOOK, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                                        "mrope_section": [4, 2, 2]},
                     "pad_token_id": ids["pad"], "eos_token_id": ids["image_end"]},
        vision_config={"depth": 2, "hidden_size": 32, "num_heads": 2, "image_size": 32, "patch_size": 8,
                       "intermediate_size": 32},
        vq_config={"embed_dim": 32, "num_embeddings": CODEBOOK, "latent_channels": 32},
        image_token_id=ids["image"], image_start_token_id=ids["image_start"], image_end_token_id=ids["image_end"],
    )
    torch.manual_seed(seed + 1)
    vision_language_encoder = GlmImageForConditionalGeneration(config)
    vision_language_encoder.generation_config.pad_token_id = ids["pad"]
    vision_language_encoder.generation_config.eos_token_id = ids["image_end"]
    vision_language_encoder.generation_config.bos_token_id = ids["image_start"]
    torch.manual_seed(seed + 2)
    transformer = GlmImageTransformer2DModel(
        patch_size=2, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=2,
        text_embed_dim=32, time_embed_dim=16, condition_dim=8, prior_vq_quantizer_codebook_size=CODEBOOK,
    )
    torch.manual_seed(seed + 3)
    vae = AutoencoderKL(
        block_out_channels=(4, 8, 16, 16), in_channels=3, out_channels=3, latent_channels=4, norm_num_groups=4,
        down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4, sample_size=64,
        latents_mean=[0.0] * 4, latents_std=[1.0] * 4,
    )
    return {"tokenizer": byt5, "processor": processor, "text_encoder": text_encoder,
            "vision_language_encoder": vision_language_encoder, "vae": vae, "transformer": transformer,
            "scheduler": FlowMatchEulerDiscreteScheduler()}


def build_tiny_glm_image(out: Path, *, seed: int = 0) -> Path:
    """Save a tiny `GlmImagePipeline` folder to `out` (see the module docstring); returns `out`.
    Use sizes of 32 x k pixels (e.g. 32x32: one large-grid token, upsampled to 2x2 DiT patches)."""
    pipe = GlmImagePipeline(**glm_components(seed))
    pipe.save_pretrained(out, safe_serialization=True)
    return Path(out)


__all__ = ["build_tiny_glm_image", "glm_components", "glm_processor"]
