"""Context folding for Wan's cross-attention: the zero padding rows of the prompt run as ONE row.

``WanPipeline`` pads every prompt's UMT5 embeddings with zero rows up to ``max_sequence_length``
(512 by default) and passes no attention mask, so the transformer attends to all 512 rows. The
context path of a Wan block is token-wise (``text_embedder`` MLP, key/value projections, RMS
norm of the keys) and carries no position, so all the zero rows give one identical key/value
pair. Attention over ``k`` identical keys with logit ``s`` equals attention over one of them with
logit ``s + log k``; folding the padding into one row with that bias computes the same function
(within float rounding) on ``L + 1`` rows instead of 512. diffserve's SD3 path does the same for
its zero T5 rows (:mod:`diffserve.acceleration.context_folding`).

This module is used to train the built-in video model (``diffserve.models.digits_video.train``),
~2x faster than attending to 512 rows; ``tests/test_digits_video_model.py`` checks that the
folded and the full forward agree. The shipped weights need none of it: diffusers' stock
``WanPipeline`` computes the same result the long way.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from diffusers import WanTransformer3DModel
from diffusers.models.transformers.transformer_wan import WanAttnProcessor


class FoldedCrossAttnProcessor(WanAttnProcessor):
    """Wan attention processor whose LAST context row stands for ``fold_count`` identical rows.

    Tensors as in diffusers' ``WanAttnProcessor``: hidden_states (B, N, D), encoder_hidden_states
    (B, L + 1, D_text-projected) with the folded row last; returns (B, N, D). Only for the
    cross-attention (``attn2``) of text-to-video blocks (no image context).
    """

    def __init__(self, fold_count: int):
        super().__init__()
        if fold_count < 1:
            raise ValueError(f"fold_count must be >= 1, got {fold_count}")
        self.log_fold_count = math.log(fold_count)

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        if encoder_hidden_states is None or attention_mask is not None:
            raise ValueError("FoldedCrossAttnProcessor is for unmasked cross-attention only")
        n_context = encoder_hidden_states.shape[1]
        # additive bias (1, 1, 1, L + 1): +log(k) on the folded (last) key
        bias = F.pad(hidden_states.new_zeros(1, 1, 1, n_context - 1), (0, 1), value=self.log_fold_count)
        return super().__call__(attn, hidden_states, encoder_hidden_states, bias, rotary_emb)


def append_folded_row(prompt_embeds: torch.Tensor, max_sequence_length: int) -> tuple[torch.Tensor, int]:
    """Append ONE zero row standing for the padding up to ``max_sequence_length`` rows.

    Args:
        prompt_embeds: (B, L, D) prompt embeddings padded with zero rows to the longest prompt's
            length ``L`` (``WanPipeline.encode_prompt(..., max_sequence_length=L)``).
        max_sequence_length: the length the pipeline pads to at inference (512).

    Returns:
        ``(folded, fold_count)``: (B, L + 1, D) whose last row is zero, and the number of zero
        rows it stands for (``max_sequence_length - L``). With
        :class:`FoldedCrossAttnProcessor` (``fold_count``) the transformer computes what it does
        on the ``max_sequence_length``-row embeddings.

    Raises:
        ValueError: if ``L >= max_sequence_length`` (no padding left to fold).
    """
    length = prompt_embeds.shape[1]
    if length >= max_sequence_length:
        raise ValueError(f"{length} prompt rows leave no padding to fold (max_sequence_length {max_sequence_length})")
    zero = prompt_embeds.new_zeros(len(prompt_embeds), 1, prompt_embeds.shape[2])
    return torch.cat([prompt_embeds, zero], 1), max_sequence_length - length


def install_folded_cross_attention(transformer: WanTransformer3DModel, fold_count: int) -> None:
    """Give every block's cross-attention a :class:`FoldedCrossAttnProcessor` for ``fold_count``."""
    for block in transformer.blocks:
        block.attn2.set_processor(FoldedCrossAttnProcessor(fold_count))


def uninstall_folded_cross_attention(transformer: WanTransformer3DModel) -> None:
    """Restore diffusers' stock ``WanAttnProcessor`` on every cross-attention."""
    for block in transformer.blocks:
        block.attn2.set_processor(WanAttnProcessor())
