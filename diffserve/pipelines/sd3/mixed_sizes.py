"""Mixed sizes in one SD3 forward (`diffserve.pipelines.token_spans`): each row its own
positions and attention span.

`install_token_spans` changes three things of an `SD3Transformer2DModel`, all inert in a forward
whose rows all have the latents' size (every forward outside diffserve's step batches):

- its ``pos_embed`` (`PatchEmbed`) takes a `TokenLayout` strip: the same patch projection, then
  each row's own position embedding (the cropped sin-cos grid of its solo size, what
  ``PatchEmbed.cropped_pos_embed`` gives its solo forward) instead of one grid for the batch;
- its joint attentions mask each row's padded image keys (`JointAttnProcessor2_0`'s
  computation with an additive bias; with context folding, `FoldedContextAttnProcessor` adds
  the same mask to its fold bias), in forwards whose ``joint_attention_kwargs`` say ``spans``
  (the adapter sets it only for a strip): a forward of one size runs exactly the code it ran
  before, so regionally compiled blocks see no new guard;
- in an eager forward its joint blocks run once per row size on that size's real tokens only
  (`_grouped_block_forward`, `diffserve.pipelines.length_groups`: the stock block, no mask, no
  padded token computed); the strip between blocks keeps the padded layout. A compiled block or
  a CUDA graph capture keeps the masked padded path above.

The rest of the forward (time/text embedding, norm_out, proj_out, unpatchify) is per row or per
token, so it runs on the strip as it is.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable

import torch
from diffusers.models.attention_processor import Attention, JointAttnProcessor2_0

from diffserve.pipelines.joint_attention import joint_output, joint_qkv
from diffserve.pipelines.length_groups import gather_rows, length_groups, scatter_rows
from diffserve.pipelines.row_data import narrowed_rows
from diffserve.pipelines.token_spans import attention_bias, is_strip, strip_positions


class SpanJointAttnProcessor(JointAttnProcessor2_0):
    """`JointAttnProcessor2_0` that masks each row's padded image keys in a forward over rows of
    different sizes (``spans=True``, `token_spans.attention_bias`); the stock processor otherwise.

    Tensors: hidden_states (B, N_img, D), encoder_hidden_states (B, N_ctx, D_ctx); returns the
    pair with the same shapes.
    """

    def __call__(self, attn: Attention, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, spans: bool = False, *args, **kwargs):
        n_image = hidden_states.shape[1]
        if encoder_hidden_states is None or not spans:
            return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, *args, **kwargs)
        bias = attention_bias(n_image, n_image + encoder_hidden_states.shape[1], hidden_states.dtype,
                              hidden_states.device)
        if bias is None:
            return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, *args, **kwargs)
        query, key, value = joint_qkv(attn, hidden_states, encoder_hidden_states)
        return joint_output(attn, query, key, value, n_image, bias.to(query.dtype))


def _span_patch_embed(self, latent: torch.Tensor) -> torch.Tensor:
    """`PatchEmbed.forward` that, on a `TokenLayout` strip (B, C, p, L_max * p), adds each
    row's own position embedding (`token_spans.strip_positions`); stock otherwise."""
    if not is_strip(tuple(latent.shape[-2:])):
        return type(self).forward(self, latent)
    latent = self.proj(latent).flatten(2).transpose(1, 2)  # (B, L_max, D)
    if self.layer_norm:
        latent = self.norm(latent)
    if self.pos_embed is None:
        return latent
    positions = strip_positions(latent.shape[1], self._solo_positions, torch.float32, latent.device)
    return (latent + positions).to(latent.dtype)


def _solo_positions(self, height: int, width: int) -> torch.Tensor:
    """(1, h/p * w/p, D) the position embedding a solo forward of latents (height, width) adds."""
    if self.pos_embed_max_size:
        return self.cropped_pos_embed(height, width)
    from diffusers.models.embeddings import get_2d_sincos_pos_embed

    grid = (height // self.patch_size, width // self.patch_size)
    if grid == (self.height, self.width):
        return self.pos_embed
    return get_2d_sincos_pos_embed(embed_dim=self.pos_embed.shape[-1], grid_size=grid, base_size=self.base_size,
                                   interpolation_scale=self.interpolation_scale, device=self.pos_embed.device,
                                   output_type="pt").float().unsqueeze(0)


def _grouped_block_forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                           temb: torch.Tensor, joint_attention_kwargs: dict | None = None, *,
                           grouped: Callable[[], bool]):
    """`JointTransformerBlock.forward` that, in an eager forward over a strip of rows of
    different sizes (``spans`` set, `length_groups.length_groups` of the strip not None), runs
    the stock block once per row size on hidden_states ``[rows, :n]`` (B, L_max, D) ->
    (g, n, D), encoder_hidden_states and temb ``[rows]``, without ``spans`` (nothing padded
    inside a group) and with the forward context narrowed to the group; returns
    ``(encoder_hidden_states, hidden_states)`` like the stock block (None context for a
    ``context_pre_only`` block), hidden_states zero on padded tokens. `grouped()` False (the
    adapter's `PipelineAdapter.length_groups`): the stock block over the padded rows."""
    stock = type(self).forward
    groups = length_groups(hidden_states.shape[1], hidden_states.device) \
        if joint_attention_kwargs and joint_attention_kwargs.get("spans") and grouped() else None
    if groups is None:
        return stock(self, hidden_states, encoder_hidden_states, temb, joint_attention_kwargs)
    kwargs = {k: v for k, v in joint_attention_kwargs.items() if k != "spans"} or None
    out_hidden = hidden_states.new_zeros(hidden_states.shape)
    out_context = None
    for group in groups:
        with narrowed_rows(group.members):
            context, hidden = stock(self, gather_rows(hidden_states, group, group.tokens),
                                    gather_rows(encoder_hidden_states, group), gather_rows(temb, group), kwargs)
        scatter_rows(out_hidden, group, hidden)
        if context is not None:
            if out_context is None:
                out_context = context.new_empty(encoder_hidden_states.shape[0], *context.shape[1:])
            scatter_rows(out_context, group, context)
    return out_context, out_hidden


def install_token_spans(transformer: torch.nn.Module, folded: bool, grouped: Callable[[], bool] = lambda: True) -> None:
    """Make an `SD3Transformer2DModel` run rows of different sizes in one forward (see the
    module docstring): its ``pos_embed`` forward (an instance attribute: weights and state dict
    unchanged), every joint block's forward (`_grouped_block_forward`: per row size in eager
    mixed forwards while `grouped()` says so) and, unless context folding installed its own span-aware processor
    (`folded`), a `SpanJointAttnProcessor` on every joint attention."""
    embed = transformer.pos_embed
    embed.forward = types.MethodType(_span_patch_embed, embed)
    embed._solo_positions = types.MethodType(_solo_positions, embed)
    for block in transformer.transformer_blocks:
        block.forward = types.MethodType(functools.partial(_grouped_block_forward, grouped=grouped), block)
    if folded:
        return
    for module in transformer.modules():
        if isinstance(module, Attention) and getattr(module, "add_k_proj", None) is not None:
            module.set_processor(SpanJointAttnProcessor())
