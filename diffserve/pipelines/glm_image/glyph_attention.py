"""GLM-Image's joint attention with a correct key mask for padded glyph tokens.

Requests whose glyph embeddings (the T5 encoding of the prompt's quoted text) differ in length
share a forward with the shorter ones right-padded. diffusers' `GlmImageAttnProcessor` turns a
text mask into a FLOAT 0/1 matrix that SDPA adds to the logits (it biases rather than masks), so
this processor takes the mask as ``glyph_mask`` (rows, L_text) bool (True = a real token) in
``attention_kwargs`` and lets no query attend a padded key; each row then equals its unpadded
forward within float rounding. Without ``glyph_mask`` it computes exactly what
`GlmImageAttnProcessor` computes for text-to-image (no KV cache).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from diffusers.models.attention_processor import Attention
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers.transformer_glm_image import GlmImageAttnProcessor


class MaskedGlyphAttnProcessor(GlmImageAttnProcessor):
    """`GlmImageAttnProcessor` for text-to-image with a boolean glyph key mask.

    Tensors: hidden_states (B, N_img, D), encoder_hidden_states (B, N_text, D),
    ``glyph_mask`` (B, N_text) bool or None; returns (hidden_states, encoder_hidden_states).

    Raises:
        ValueError: a KV cache is passed (image-to-image conditioning is not served).
    """

    def __call__(self, attn: Attention, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                 attention_mask: torch.Tensor | None = None,
                 image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None, kv_cache=None,
                 glyph_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if kv_cache is not None:
            raise ValueError("MaskedGlyphAttnProcessor serves text-to-image only (no KV cache)")
        dtype = encoder_hidden_states.dtype
        batch, n_text = encoder_hidden_states.shape[:2]
        x = torch.cat([encoder_hidden_states, hidden_states], dim=1)
        query = attn.to_q(x).unflatten(2, (attn.heads, -1))
        key = attn.to_k(x).unflatten(2, (attn.heads, -1))
        value = attn.to_v(x).unflatten(2, (attn.heads, -1))
        if attn.norm_q is not None:
            query = attn.norm_q(query).to(dtype=dtype)
        if attn.norm_k is not None:
            key = attn.norm_k(key).to(dtype=dtype)
        if image_rotary_emb is not None:
            query[:, n_text:] = apply_rotary_emb(query[:, n_text:], image_rotary_emb, sequence_dim=1,
                                                 use_real_unbind_dim=-2)
            key[:, n_text:] = apply_rotary_emb(key[:, n_text:], image_rotary_emb, sequence_dim=1,
                                               use_real_unbind_dim=-2)
        mask = None
        if glyph_mask is not None:
            keys = torch.cat([glyph_mask, glyph_mask.new_ones(batch, x.shape[1] - n_text)], dim=1)
            mask = keys[:, None, None, :]
        out = F.scaled_dot_product_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                             attn_mask=mask).transpose(1, 2)
        out = out.flatten(2, 3).to(query.dtype)
        out = attn.to_out[1](attn.to_out[0](out))
        encoder_hidden_states, hidden_states = out.split([n_text, out.shape[1] - n_text], dim=1)
        return hidden_states, encoder_hidden_states


def install_masked_glyph_attention(transformer: torch.nn.Module) -> int:
    """Give every block of a `GlmImageTransformer2DModel` a `MaskedGlyphAttnProcessor`.

    Returns:
        The number of attention modules changed.
    """
    for block in transformer.transformer_blocks:
        block.attn1.set_processor(MaskedGlyphAttnProcessor())
    return len(transformer.transformer_blocks)


__all__ = ["MaskedGlyphAttnProcessor", "install_masked_glyph_attention"]
