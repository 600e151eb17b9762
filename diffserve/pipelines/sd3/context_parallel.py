"""Ulysses sequence parallelism for `SD3Transformer2DModel` (diffusers declares no
context-parallel plan for it, and its attention processors call ``scaled_dot_product_attention``
directly, which the context-parallel hooks cannot reach).

`prepare_sd3_context_parallel` swaps SD3's joint (and SD3.5's image-only dual) attention
processors for ones that route attention through diffusers' ``dispatch_attention_fn`` (where
the Ulysses all-to-all happens) and returns the plan: split the image and text token streams at
the first block's input, gather the image tokens after ``proj_out`` (before unpatchify). Every
other operation of an MMDiT block is per token, so each rank runs it on its own tokens; joint
attention sees the whole sequence through the all-to-all. Context folding (a +log(k) bias on one
text token) is not used together with it.
"""

from __future__ import annotations

import torch
from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.attention_processor import Attention

from diffserve.pipelines.joint_attention import joint_qkv


class SD3DispatchJointAttnProcessor:
    """`JointAttnProcessor2_0` (diffusers 0.42) computing attention with
    ``dispatch_attention_fn`` so context parallelism applies. Tensors as there: hidden_states
    (B, N_img, D), encoder_hidden_states (B, N_txt, D); q/k/v laid out (B, S, H, d)."""

    _attention_backend = None
    _parallel_config = None

    def __call__(self, attn: Attention, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor = None,
                 attention_mask: torch.Tensor | None = None, *args, **kwargs):
        n_image = hidden_states.shape[1]
        query, key, value = joint_qkv(attn, hidden_states, encoder_hidden_states, heads_first=False)
        out = dispatch_attention_fn(query, key, value, backend=self._attention_backend,
                                    parallel_config=self._parallel_config)
        out = out.flatten(2, 3).to(query.dtype)
        if encoder_hidden_states is not None:
            out, encoder_hidden_states = out[:, :n_image], out[:, n_image:]
            if not attn.context_pre_only:
                encoder_hidden_states = attn.to_add_out(encoder_hidden_states)
        out = attn.to_out[1](attn.to_out[0](out))
        if encoder_hidden_states is not None:
            return out, encoder_hidden_states
        return out


def prepare_sd3_context_parallel(transformer: torch.nn.Module) -> dict:
    """Install dispatch-based processors on every attention of `transformer`; return the
    context-parallel plan (see the module docstring)."""
    for module in transformer.modules():
        if isinstance(module, Attention):
            module.set_processor(SD3DispatchJointAttnProcessor())
    return {
        "transformer_blocks.0": {
            "hidden_states": ContextParallelInput(split_dim=1, expected_dims=3, split_output=False),
            "encoder_hidden_states": ContextParallelInput(split_dim=1, expected_dims=3, split_output=False),
        },
        "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
    }
