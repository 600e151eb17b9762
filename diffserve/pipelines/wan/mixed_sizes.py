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
"""

from __future__ import annotations

import torch
from diffusers.models.transformers.transformer_wan import WanAttnProcessor

from diffserve.pipelines.row_data import NO_ROW_DATA, RowData, current_rows
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


def install_token_spans(transformer: torch.nn.Module) -> bool:
    """Let a `WanTransformer3DModel` run rows of different sizes and frame counts: the key-mask
    hook on its ``rope`` and a `SpanSelfAttnProcessor` on every block's ``attn1`` (weights and
    state dict unchanged; stock behaviour in forwards without padded rows). Idempotent.
    Returns True."""
    if not getattr(transformer.rope, "_diffserve_token_spans", False):
        transformer.rope.register_forward_hook(_rope_hook)
        transformer.rope._diffserve_token_spans = True
    for block in transformer.blocks:
        block.attn1.set_processor(SpanSelfAttnProcessor())
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


__all__ = ["SpanSelfAttnProcessor", "install_token_spans", "key_mask", "select_rotary", "zero_outside"]
