"""Context folding: run SD3's all-zero T5 placeholder tokens as ONE token.

An SD3 folder without T5 (``text_encoder_3`` null) gets ``max_sequence_length`` (256) rows of
zeros appended to its CLIP prompt embeddings (diffusers' ``_get_t5_prompt_embeds``). Every
context-side operation of the MMDiT is token-wise except joint attention, and there is no
positional embedding on the context, so those rows stay identical in every layer: they give
identical keys and values, and attention over ``k`` identical keys with logit ``s`` equals
attention over one such key with logit ``s + log k``. Folding them into one row with a
``+log k`` attention bias computes the same image (within float rounding) with 256 fewer
tokens per row: on the built-in digits model the sequence drops from 288 to 33 tokens.

The bias is added in the attention dtype: in fp32 the result matches the full context to
~1e-6; in bf16, log(256) = 5.545 rounds to 5.531, which scales the folded token's attention
weight by ~1.4%, the same order as bf16's own rounding of the 256 separate keys.

The fold count travels with each forward (``joint_attention_kwargs={"fold_count": k}``, k = the
request's ``max_sequence_length``), so requests with different budgets stay exact; the SD3
adapter keeps them in different batches (the budget is part of its batch key).

The same identity is used to train the built-in model (`training.digits.train`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from diffusers.models.attention_processor import Attention, AttnProcessor2_0, JointAttnProcessor2_0

from diffserve.pipelines.joint_attention import joint_output, joint_qkv
from diffserve.pipelines.token_spans import attention_bias


class FoldedContextAttnProcessor(JointAttnProcessor2_0):
    """SD3 joint-attention processor whose LAST context token stands for `fold_count`
    identical tokens (its attention logit gets ``+log(fold_count)``).

    Tensors: hidden_states (B, N_img, D), encoder_hidden_states (B, N_ctx, D_ctx) with the
    folded token last; returns the pair with the same shapes, like `JointAttnProcessor2_0`.

    Args:
        fold_count: default count when a forward passes none (the pipeline default 256).
    """

    def __init__(self, fold_count: int = 256):
        super().__init__()
        if fold_count < 1:
            raise ValueError(f"fold_count must be >= 1, got {fold_count}")
        self.fold_count = fold_count

    def __call__(
        self,
        attn: Attention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        fold_count: int | None = None,
        spans: bool = False,
        *args,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        fold_count = fold_count or self.fold_count
        n_image = hidden_states.shape[1]

        query, key, value = joint_qkv(attn, hidden_states, encoder_hidden_states)

        # additive bias: +log(k) on the folded (last) key; in a forward over rows of different
        # sizes (`spans`, set by the adapter) also -inf on each row's padded image keys
        bias = attention_bias(n_image, key.shape[2], query.dtype, query.device, fold_count) if spans else None
        if bias is None:  # (1, 1, 1, N_img + N_ctx)
            bias = F.pad(query.new_zeros(1, 1, 1, key.shape[2] - 1), (0, 1), value=math.log(fold_count))
        return joint_output(attn, query, key, value, n_image, bias)


class ImageOnlyAttnProcessor(AttnProcessor2_0):
    """`AttnProcessor2_0` that accepts (and ignores) ``fold_count``, for SD3.5's image-only
    dual attention, which receives the same ``joint_attention_kwargs``."""

    def __call__(self, attn: Attention, hidden_states: torch.Tensor, encoder_hidden_states=None,
                 attention_mask=None, temb=None, fold_count: int | None = None, spans: bool = False, *args,
                 **kwargs):
        return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, temb)


def install_folded_context_attention(transformer: torch.nn.Module, fold_count: int = 256) -> int:
    """Give every joint (image + context) attention of an SD3 transformer a
    `FoldedContextAttnProcessor` (default count `fold_count`); image-only attentions (SD3.5's
    dual attention) get an `ImageOnlyAttnProcessor`.

    Returns:
        The number of joint attention modules changed.
    """
    changed = 0
    for module in transformer.modules():
        if not isinstance(module, Attention):
            continue
        if getattr(module, "add_k_proj", None) is not None:
            module.set_processor(FoldedContextAttnProcessor(fold_count))
            changed += 1
        elif isinstance(module.processor, AttnProcessor2_0):
            module.set_processor(ImageOnlyAttnProcessor())
    return changed


def fold_placeholder_rows(prompt_embeds: torch.Tensor, num_kept: int) -> torch.Tensor:
    """Keep the first `num_kept` context rows plus ONE placeholder row.

    Args:
        prompt_embeds: (rows, num_kept + fold_count, D); rows after `num_kept` are all zero.

    Returns:
        (rows, num_kept + 1, D), a new contiguous tensor (the long one can be freed).
    """
    return prompt_embeds[:, : num_kept + 1].contiguous()
