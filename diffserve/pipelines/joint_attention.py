"""The query/key/value projections of an MM-DiT joint attention (SD3's ``JointAttnProcessor2_0``,
Esser et al. 2024, "Scaling Rectified Flow Transformers", arXiv:2403.03206), shared by the
attention processors that change what the joint attention attends to (SD3's context folding and
context parallelism, the AR-context attention of the multi-stage models)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from diffusers.models.attention_processor import Attention


def joint_qkv(attn: Attention, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None,
              heads_first: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Project the image tokens and (when given) the context tokens to per-head query, key and
    value, apply the block's q/k norms, and join them image tokens first, as diffusers'
    ``JointAttnProcessor2_0`` does.

    Args:
        attn: the block's `Attention` (``to_q/k/v``, ``add_q/k/v_proj``, optional ``norm_q``,
            ``norm_k``, ``norm_added_q``, ``norm_added_k``).
        hidden_states: image tokens (B, N_img, C), the model's dtype.
        encoder_hidden_states: context tokens (B, N_ctx, C_ctx), or None (image tokens only).
        heads_first: the layout of the results: (B, H, N, D) when True (what
            ``F.scaled_dot_product_attention`` takes), else (B, N, H, D) (diffusers'
            ``dispatch_attention_fn``).

    Returns:
        ``(query, key, value)``, each with N = N_img + N_ctx tokens (N_img without context),
        D = the projection width / ``attn.heads``, the projections' dtype.
    """
    batch_size = hidden_states.shape[0]
    token_dim = 2 if heads_first else 1

    def heads(x: torch.Tensor) -> torch.Tensor:
        x = x.view(batch_size, -1, attn.heads, x.shape[-1] // attn.heads)
        return x.transpose(1, 2) if heads_first else x

    query, key, value = heads(attn.to_q(hidden_states)), heads(attn.to_k(hidden_states)), heads(attn.to_v(hidden_states))
    if attn.norm_q is not None:
        query = attn.norm_q(query)
    if attn.norm_k is not None:
        key = attn.norm_k(key)
    if encoder_hidden_states is None:
        return query, key, value
    context_query = heads(attn.add_q_proj(encoder_hidden_states))
    context_key = heads(attn.add_k_proj(encoder_hidden_states))
    context_value = heads(attn.add_v_proj(encoder_hidden_states))
    if attn.norm_added_q is not None:
        context_query = attn.norm_added_q(context_query)
    if attn.norm_added_k is not None:
        context_key = attn.norm_added_k(context_key)
    return (torch.cat([query, context_query], dim=token_dim), torch.cat([key, context_key], dim=token_dim),
            torch.cat([value, context_value], dim=token_dim))


def joint_output(attn: Attention, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, num_image: int,
                 attn_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over `joint_qkv`'s (B, H, N, D) tensors with an additive or boolean
    `attn_mask` (broadcastable to (B, H, N, N); None: none), split back into the image stream
    (B, num_image, C) after ``to_out`` and the context stream after ``to_add_out`` (as it is
    for a ``context_pre_only`` block), as diffusers' ``JointAttnProcessor2_0`` returns them."""
    batch_size = query.shape[0]
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask)
    out = out.transpose(1, 2).reshape(batch_size, -1, attn.heads * query.shape[-1]).to(query.dtype)
    hidden_states, encoder_hidden_states = out[:, :num_image], out[:, num_image:]
    hidden_states = attn.to_out[1](attn.to_out[0](hidden_states))
    if not attn.context_pre_only:
        encoder_hidden_states = attn.to_add_out(encoder_hidden_states)
    return hidden_states, encoder_hidden_states
