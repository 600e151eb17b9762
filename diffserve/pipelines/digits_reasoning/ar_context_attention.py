"""Joint attention that also reads an LM's K/V (BAGEL-style) for an SD3-architecture DiT.

In `digits-reasoning`, the DiT's image and context tokens attend to their own keys/values and,
in layer ``i``, to the LM's layer-``i`` keys/values of the prompt and the generated answer
(BAGEL, Deng et al. 2025, arXiv:2505.14683, section 3: the generation tokens attend to the
understanding tokens' KV cache). The LM's KV heads and head dim equal the DiT's heads and head
dim, and the DiT has as many layers as the LM, so no projection is needed: the DiT learns
queries that read the LM's keys.

The K/V travel in the forward's ``joint_attention_kwargs``: ``ar_kv`` (rows, L, layers, 2, H, D)
and ``ar_kv_mask`` (rows, L) bool (True = a real token) or None when no row is padded. Rows with
shorter contexts are right-padded and masked, so each row equals its forward alone within float
rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from diffusers.models.attention_processor import Attention, JointAttnProcessor2_0

from diffserve.pipelines.joint_attention import joint_qkv


class ARContextJointAttnProcessor(JointAttnProcessor2_0):
    """SD3 joint attention over [image tokens; context tokens; the LM's layer-`layer` K/V].

    Tensors: hidden_states (B, N_img, D_model), encoder_hidden_states (B, N_ctx, D_model);
    ``ar_kv`` (B, L, layers, 2, heads, head_dim) in any float dtype (cast to the query's);
    ``ar_kv_mask`` (B, L) bool or None. Returns (hidden_states, encoder_hidden_states) like
    `JointAttnProcessor2_0`.

    Args:
        layer: which LM layer this block reads.

    Raises:
        ValueError: at call time, when ``ar_kv`` is missing or its heads / head dim differ from
            the attention's.
    """

    def __init__(self, layer: int):
        super().__init__()
        self.layer = layer

    def __call__(self, attn: Attention, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, ar_kv: torch.Tensor | None = None,
                 ar_kv_mask: torch.Tensor | None = None, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        if ar_kv is None:
            raise ValueError("ARContextJointAttnProcessor needs ar_kv (the LM's K/V) in joint_attention_kwargs")
        batch_size, n_image = hidden_states.shape[:2]

        n_context = 0 if encoder_hidden_states is None else encoder_hidden_states.shape[1]
        query, key, value = joint_qkv(attn, hidden_states, encoder_hidden_states)
        layer_kv = ar_kv[:, :, self.layer]  # (B, L, 2, H, D)
        if layer_kv.shape[-2] != attn.heads or layer_kv.shape[-1] != query.shape[-1]:
            raise ValueError(f"the LM's K/V have {layer_kv.shape[-2]} heads x {layer_kv.shape[-1]}, the DiT's "
                             f"attention {attn.heads} heads x {query.shape[-1]}")
        layer_kv = layer_kv.to(query.dtype).permute(2, 0, 3, 1, 4)  # (2, B, H, L, D)
        key = torch.cat([key, layer_kv[0]], dim=2)
        value = torch.cat([value, layer_kv[1]], dim=2)
        mask = None
        if ar_kv_mask is not None:  # (B, 1, 1, N_img + N_ctx + L): own tokens always, LM tokens where real
            own = ar_kv_mask.new_ones(batch_size, n_image + n_context)
            mask = torch.cat([own, ar_kv_mask], dim=1)[:, None, None, :]
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask)
        out = out.transpose(1, 2).reshape(batch_size, -1, attn.heads * query.shape[-1]).to(query.dtype)
        hidden_states, encoder_hidden_states = out[:, :n_image], out[:, n_image:]
        hidden_states = attn.to_out[1](attn.to_out[0](hidden_states))
        if n_context and not attn.context_pre_only:
            encoder_hidden_states = attn.to_add_out(encoder_hidden_states)
        return hidden_states, encoder_hidden_states


def install_ar_context_attention(transformer: torch.nn.Module) -> int:
    """Give block ``i`` of an `SD3Transformer2DModel` an `ARContextJointAttnProcessor(i)`.

    Returns:
        The number of blocks changed (the transformer's ``num_layers``).

    Raises:
        ValueError: a block uses SD3.5's dual (image-only) attention, which this model does
            not have.
    """
    for i, block in enumerate(transformer.transformer_blocks):
        if getattr(block, "attn2", None) is not None:
            raise ValueError("install_ar_context_attention: dual-attention blocks are not supported")
        block.attn.set_processor(ARContextJointAttnProcessor(i))
    return len(transformer.transformer_blocks)


__all__ = ["ARContextJointAttnProcessor", "install_ar_context_attention"]
