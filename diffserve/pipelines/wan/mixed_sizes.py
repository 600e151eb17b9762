"""Mixed sizes AND frame counts in one Wan forward (`diffserve.pipelines.token_spans`): each
row keeps its own positions and attention span.

Wan's latents are video grids (N, C, F, h, w). Collation pads each request's latents with zeros
at the END of each axis (frames, height, width) to the batch's largest grid
(`step_batch.pad_latents`); Wan sizes are multiples of 16 pixels, so with the 8x VAE and the
(1, 2, 2) patch the padding is whole patches. diffusers' `WanTransformer3DModel` (0.42) then
needs only a key mask, because:

- its patch embedding is a Conv3d with stride == kernel == patch size: each token reads its
  own patch only, so a real token's embedding ignores the padding;
- its 3-D rotary (`WanRotaryPosEmbed`) gives the token at patch coordinate (f, y, x) the
  frequencies of rows f, y, x of three fixed per-axis tables, whatever the grid's extent: a
  real token of a padded grid keeps exactly the rotation of its solo forward (only its index
  in the flattened sequence moves, which attention does not see);
- everything else is token-wise (adaLN modulation, norms, FFN, cross-attention to the text:
  padded queries compute values nobody reads) except self-attention, whose keys must leave
  each row's padded tokens out.

`install_token_spans` puts a forward hook on the transformer's ``rope`` (the one module that
sees the padded 5-D grid and whose output reaches every block's self-attention) that, in a
forward whose rows' `token_spans.LATENT_SIZE` (F, h, w) differ from the grid, appends each
row's key mask to the rotary tuple: ``(cos, sin, mask)``. `SpanSelfAttnProcessor` (on every
block's ``attn1``) passes that mask to attention. The mask is built eagerly outside compiled
blocks, memoised per batch composition; forwards whose rows all fill the grid see the stock
``(cos, sin)`` and the stock computation. The adapter zeroes the guided prediction outside
each request's own region (`zero_outside`), so padded latents stay zero under the batched
Euler step.

With ``expand_timesteps`` (Wan 2.2 TI2V) the adapter builds the per-token timesteps on the
padded grid: tokens are frame-major, so a row's clean first frames are the first tokens either
way. Wan 2.2's two experts mix as one: the expert is the step key, the hook sits on both.

Length groups (`diffserve.pipelines.length_groups`): in an EAGER forward with padded rows every
block runs once per row `LATENT_SIZE` on that size's real tokens only (`_grouped_block_forward`):
a row's real tokens are a 3-D box at the start of the padded grid, so NOT a prefix of the
flattened sequence; each size group gathers them (`size_groups`: the positions where its key
mask is True, in raster order) from hidden_states, the rotary tables and, with per-token
timesteps, from ``temb``, runs the stock `WanTransformerBlock.forward` with the plain
``(cos, sin)`` (nothing padded, no mask: the solo forward's computation) and scatters the result
back; padded tokens leave every block zero. A compiled block or a CUDA graph capture keeps the
masked padded path above (`length_groups.grouping_enabled`).
"""

from __future__ import annotations

import functools
import math
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch
from diffusers.models.transformers.transformer_wan import WanAttnProcessor

from diffserve.pipelines.length_groups import grouping_enabled, worth_grouping
from diffserve.pipelines.row_data import NO_ROW_DATA, RowData, current_rows, narrowed_rows
from diffserve.pipelines.token_spans import LATENT_SIZE


@torch.compiler.disable  # eager: memoised per layout, no guards on the row data in compiled blocks
def key_mask(grid: tuple[int, int, int], patch: tuple[int, int, int], device: torch.device,
             rows: RowData | None = None) -> torch.Tensor | None:
    """(rows, 1, 1, N) bool self-attention key mask of the forward running now
    (`row_data.current_rows`, or `rows`), True on each row's real tokens, for latents padded
    to `grid` (F, H, W) latent pixels and split into patches `patch` (p_t, p_h, p_w): N =
    (F/p_t)(H/p_h)(W/p_w) tokens in diffusers' raster order (frames, then rows, then columns).
    None when no row is padded (every row's `LATENT_SIZE` is `grid`, or the forward carries no
    sizes). Memoised per forward layout.

    Raises:
        ValueError: a row's size exceeds the grid (the rows do not belong to this forward).
    """
    rows = current_rows() if rows is None else rows
    if rows is NO_ROW_DATA:
        return None
    sizes = rows.get(LATENT_SIZE)
    grid = tuple(grid)
    if not sizes or all(tuple(s) == grid for s in sizes):
        return None

    def build() -> torch.Tensor:
        for size in sizes:
            if any(s > g for s, g in zip(size, grid)):
                raise ValueError(f"a row of latent size {tuple(size)} in a forward over a {grid} grid")
        region = _regions(grid, sizes, patch)
        return region.reshape(region.shape[0], -1)[:, None, None, :].to(device)

    return rows.derived(("wan_key_mask", grid, tuple(patch), str(device)), build)


def _regions(grid: tuple[int, int, int], sizes, patch: tuple[int, int, int]) -> torch.Tensor:
    """(rows, F/p_t, H/p_h, W/p_w) bool on CPU: True where a cell of `grid` (F, H, W latent
    pixels, in cells of `patch`) lies inside the row's own size (f, h, w) at the start of each
    axis (`sizes`: one per row)."""
    axes = [torch.arange(g // p) for g, p in zip(grid, patch)]
    masks = []
    for size in sizes:
        real = [a < (s // p) for a, s, p in zip(axes, size, patch)]
        masks.append(real[0][:, None, None] & real[1][None, :, None] & real[2][None, None, :])
    return torch.stack(masks)


class SpanSelfAttnProcessor(WanAttnProcessor):
    """diffusers' `WanAttnProcessor` (0.42) for a block's self-attention (``attn1``) that takes
    a key mask riding on the rotary tuple: ``rotary_emb = (cos, sin, mask)`` (the `rope` hook of
    `install_token_spans`, mask (rows, 1, 1, N) bool) attends with ``attn_mask=mask``; the
    stock ``(cos, sin)`` (or None) computes as diffusers does.

    Tensors: hidden_states (B, N, D); cos / sin (1, N, 1, head_dim); returns (B, N, D).

    Raises:
        ValueError: a mask together with an ``attention_mask`` (Wan's blocks never pass one).
    """

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        if rotary_emb is not None and len(rotary_emb) == 3:
            cos, sin, mask = rotary_emb
            if attention_mask is not None:
                raise ValueError("attention_mask cannot be combined with token spans")
            return super().__call__(attn, hidden_states, encoder_hidden_states, mask, (cos, sin))
        return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)


def _rope_hook(module: torch.nn.Module, args: tuple, output: tuple[torch.Tensor, torch.Tensor]):
    """Forward hook of `WanRotaryPosEmbed`: ``(cos, sin)`` plus the forward's key mask when some
    row is padded (`key_mask` over the input's grid)."""
    hidden_states = args[0]
    mask = key_mask(tuple(hidden_states.shape[2:]), tuple(module.patch_size), hidden_states.device)
    if mask is None:
        return output
    if mask.shape[0] != hidden_states.shape[0]:
        raise ValueError(f"the forward's row data has {mask.shape[0]} rows, its latents {hidden_states.shape[0]}")
    return (*output, mask)


@dataclass(frozen=True)
class SizeGroup:
    """The rows of one `LATENT_SIZE` in a padded Wan forward and where their real tokens lie.

    Attributes:
        members: the forward rows of this size (ascending).
        rows: the same as a (g,) long tensor on the forward's device.
        positions: (n,) long, the indices of the size's n real tokens in the padded sequence of
            N tokens, ascending (raster order: the solo forward's token order).
        flat: (g * n,) long, ``rows[:, None] * N + positions[None, :]`` flattened: the group's
            real tokens in a (B * N, ...) view of a per-token tensor.
    """

    members: tuple[int, ...]
    rows: torch.Tensor
    positions: torch.Tensor
    flat: torch.Tensor


def size_groups(mask: torch.Tensor, patch: tuple[int, int, int]) -> tuple[SizeGroup, ...] | None:
    """The rows of the forward running now (`row_data.current_rows`) grouped by their
    `LATENT_SIZE` (F, h, w), with each size's real token positions.

    Args:
        mask: (B, 1, 1, N) bool key mask of this forward (`key_mask`, narrowed like the rows),
            True on each row's real tokens.
        patch: the transformer's (p_t, p_h, p_w), to count a size's tokens.

    Returns:
        One `SizeGroup` per distinct size (in order of first appearance), memoised per row
        data; None when the forward carries no sizes, its padding is too small to pay for the
        extra calls (`length_groups.worth_grouping`) or `grouping_enabled` is False.

    Raises:
        ValueError: the row data does not have the mask's row count.
    """
    if not grouping_enabled():
        return None
    rows = current_rows()
    sizes = rows.get(LATENT_SIZE) if rows is not NO_ROW_DATA else None
    if not sizes:
        return None
    if len(sizes) != mask.shape[0]:
        raise ValueError(f"the forward's row data has {len(sizes)} rows, its key mask {mask.shape[0]}")
    n_tokens = mask.shape[-1]

    def build() -> tuple[SizeGroup, ...] | None:
        distinct = list(dict.fromkeys(tuple(s) for s in sizes))
        counts = [math.prod(d // p for d, p in zip(size, patch)) for size in sizes]
        if not worth_grouping(counts, n_tokens, len(distinct)):
            return None
        groups = []
        for size in distinct:
            members = tuple(r for r, s in enumerate(sizes) if tuple(s) == size)
            real = math.prod(d // p for d, p in zip(size, patch))
            # the row's True positions in order, without a host sync (a stable sort of ~mask)
            positions = torch.argsort((~mask[members[0], 0, 0]).to(torch.uint8), stable=True)[:real]
            index = torch.tensor(members, dtype=torch.long, device=mask.device)
            flat = (index[:, None] * n_tokens + positions[None, :]).reshape(-1)
            groups.append(SizeGroup(members, index, positions, flat))
        return tuple(groups)

    return rows.derived(("wan_size_groups", n_tokens, tuple(patch), str(mask.device)), build)


def _grouped_block_forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                           temb: torch.Tensor, rotary_emb: tuple | None, *, patch: tuple[int, int, int],
                           grouped: Callable[[], bool]) -> torch.Tensor:
    """`WanTransformerBlock.forward` (diffusers 0.42) that, in an eager forward with padded rows
    (a key mask on the rotary tuple, `size_groups` not None) while `grouped()` says so, runs
    the stock block once per row size on that size's real tokens only and scatters them back.

    Tensors: hidden_states (B, N, D); encoder_hidden_states (B, L, D); temb (B, 6, D), or per
    token (B, N, 6, D) (Wan 2.2 TI2V); rotary_emb ``(cos, sin)`` each (1, N, 1, head_dim),
    plus the (B, 1, 1, N) key mask. A group of g rows with n real tokens runs the stock block
    on (g, n, D), (g, L, D), (g, 6, D) or (g, n, 6, D) and ``(cos, sin)`` (1, n, 1, head_dim)
    at its tokens' positions, with the forward context narrowed to its rows. Returns
    (B, N, D), zero on padded tokens; otherwise the stock block (masked over the padded rows).
    """
    stock = type(self).forward
    groups = None
    if rotary_emb is not None and len(rotary_emb) == 3 and grouping_enabled() and grouped():
        groups = size_groups(rotary_emb[2], patch)
    if groups is None:
        return stock(self, hidden_states, encoder_hidden_states, temb, rotary_emb)
    cos, sin, _ = rotary_emb
    batch, n_tokens, width = hidden_states.shape
    tokens = hidden_states.reshape(batch * n_tokens, width)
    per_token = temb.ndim == 4
    if per_token:
        temb_tokens = temb.reshape(batch * n_tokens, *temb.shape[2:])
    out = hidden_states.new_zeros(batch * n_tokens, width)
    for group in groups:
        g, n = len(group.members), group.positions.shape[0]
        if per_token:
            group_temb = temb_tokens.index_select(0, group.flat).view(g, n, *temb.shape[2:])
        else:
            group_temb = temb.index_select(0, group.rows)
        with narrowed_rows(group.members):  # memoised per members: plug-ins' memos last across blocks
            value = stock(self, tokens.index_select(0, group.flat).view(g, n, width),
                          encoder_hidden_states.index_select(0, group.rows), group_temb,
                          (cos.index_select(1, group.positions), sin.index_select(1, group.positions)))
        out.index_copy_(0, group.flat, value.reshape(g * n, width))
    return out.view(batch, n_tokens, width)


def install_token_spans(transformer: torch.nn.Module, grouped: Callable[[], bool] = lambda: True) -> bool:
    """Let a `WanTransformer3DModel` run rows of different sizes and frame counts: the key-mask
    hook on its ``rope``, a `SpanSelfAttnProcessor` on every block's ``attn1`` and every block's
    forward `_grouped_block_forward` (an instance attribute: per row size in eager forwards
    with padded rows while `grouped()` says so; weights and state dict unchanged; stock
    behaviour in forwards without padded rows). Idempotent. Returns True."""
    if not getattr(transformer.rope, "_diffserve_token_spans", False):
        transformer.rope.register_forward_hook(_rope_hook)
        transformer.rope._diffserve_token_spans = True
    patch = tuple(transformer.config.patch_size)
    for block in transformer.blocks:
        block.attn1.set_processor(SpanSelfAttnProcessor())
        block.forward = types.MethodType(functools.partial(_grouped_block_forward, patch=patch, grouped=grouped),
                                         block)
    return True


def select_rotary(rotary: tuple, index: torch.Tensor) -> tuple:
    """The rotary tuple of a forward over rows `index` of this one: ``(cos, sin)`` is shared,
    a key mask (third entry) keeps those rows (TeaCache computing some requests only)."""
    return rotary if len(rotary) < 3 else (rotary[0], rotary[1], rotary[2][index])


def zero_outside(guided: torch.Tensor, rows: RowData) -> torch.Tensor:
    """`guided` (N, C, F, H, W) with zeros outside each row's own region (its `LATENT_SIZE`
    (f, h, w) at the start of each axis), so the padded latents stay zero under the batched
    Euler step; `guided` itself when no row is padded. `rows`: the N latent rows' row data
    (`token_spans.latent_rows`)."""
    sizes = rows.get(LATENT_SIZE) if rows else None
    grid = tuple(guided.shape[2:])
    if not sizes or all(tuple(s) == grid for s in sizes):
        return guided

    def build() -> torch.Tensor:
        return _regions(grid, sizes, (1, 1, 1))[:, None].to(guided.device)

    mask = rows.derived(("wan_region", grid, str(guided.device)), build)
    return guided.masked_fill(~mask, 0)


__all__ = ["SizeGroup", "SpanSelfAttnProcessor", "install_token_spans", "key_mask", "select_rotary", "size_groups",
           "zero_outside"]
