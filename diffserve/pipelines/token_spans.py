"""Token spans: rows of different sizes in ONE denoiser forward (mixed resolutions).

A family that declares ``PipelineAdapter.mixed_sizes`` drops the size from its batch key: its
requests of different resolutions share a step batch. Each request says, as per-row data
(`row_data`), how big it is:

- ``LATENT_SIZE``: its latent's spatial size (h, w) in latent pixels (video, Wan: (F, h, w),
  latent frames too; `wan/mixed_sizes.py`);
- ``IMAGE_TOKENS``: the image tokens that size makes (h/p x w/p for a patch size p).

Collation pads every request's latents to the batch's largest (h, w) (`step_batch`: zeros at
the bottom/right, each request keeps a cropped view of its own region), so the diffusion
scheduler still steps the batch as one tensor. Inside the forward the rows are laid out by
**padding with masks** (chosen by measurement over packing, `benchmarks/mixed_attention.py`
and the README's "Mixed sizes" section): `TokenLayout.to_strip` gathers each row's real patches
into a one-patch-tall strip of ``L_max`` patches (raster order, the same tokens its solo
forward has), so the stock patch embedding, blocks, norm and unpatchify run on it unchanged;
the family's plug-ins give each row its own positions (its solo run's position embedding,
`TokenLayout.positions`) and mask the padded image tokens out of every attention's keys
(`key_padding_mask`). `TokenLayout.from_strip` scatters the prediction back to the padded
latent layout (zeros outside each row's region). Padded query rows compute values nobody
reads; no real row attends to them, so each row equals its solo forward within float rounding.
In eager SD3-family forwards the blocks then skip the padding altogether: each runs once per
row token count on real tokens only (`length_groups`); the strip stays the layout between them.

Families whose latents are packed token sequences (Flux, Qwen-Image: one token per 2x2 latent
patch, raster order) need no strip: collation right-pads each request's sequence to the longest
(`step_batch.pad_latents`), and their attention processors give each row its own RoPE table and
mask its padded keys (`flux/mixed_sizes.py`, `qwen_image/mixed_sizes.py`); `sizes_differ` says
when a forward needs that, `zero_padded_tokens` zeroes the guided prediction of padded tokens
(after guidance: a norm-rescaled CFG of zero vectors would divide 0 by 0).

Edits append reference-image tokens after the noisy ones (Flux Kontext, Qwen-Image-Edit): a
request also says its reference's latent size (``REFERENCE_SIZE``) and token count
(``REFERENCE_TOKENS``), collation right-pads the reference segment to the batch's longest
``R_max`` too, so a forward's image sequence is ``[noisy (L_max) | reference (R_max)]`` with each
row real on the first tokens of each segment; `image_key_mask` marks the real keys of both
segments and the families' processors give both segments each row's own positions.

When every row of a forward has the same size nothing of this runs (no strip, no mask).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from diffserve.pipelines.row_data import NO_ROW_DATA, RowData, current_rows

#: Row-data key: a request's latent spatial size (h, w) in latent pixels ((F, h, w) for video).
LATENT_SIZE = "latent_size"
#: Row-data key: the image tokens of a request's rows (its sequence length before context).
IMAGE_TOKENS = "image_tokens"
#: Row-data key: an edit's reference-image latent size (h, w) in latent pixels.
REFERENCE_SIZE = "reference_size"
#: Row-data key: an edit's reference-image tokens (appended after the noisy image tokens).
REFERENCE_TOKENS = "reference_tokens"


class TokenLayout:
    """Where each row's tokens sit in a padded strip, for a forward over rows of different sizes.

    Args:
        sizes: each forward row's latent size (h, w) (row data `LATENT_SIZE`).
        grid: the padded latents' spatial size (H, W) (the batch's largest h and w).
        patch: the denoiser's patch size p (h, w, H, W multiples of it).

    Attributes:
        tokens: (rows,) each row's token count ``h/p * w/p``.
        longest: L_max, the strip's token count.
        index: (rows, L_max) long index of each strip token in the padded grid's raster order
            (padded tokens point at slot ``H/p * W/p``, one past the grid).
        mask: (rows, L_max) bool, True on real tokens.
    """

    def __init__(self, sizes: Sequence[tuple[int, int]], grid: tuple[int, int], patch: int):
        self.sizes = [tuple(s) for s in sizes]
        self.grid = tuple(grid)
        self.patch = patch
        gh, gw = grid[0] // patch, grid[1] // patch
        self.slots = gh * gw
        self.tokens = [(h // patch) * (w // patch) for h, w in self.sizes]
        self.longest = max(self.tokens)
        index = torch.full((len(self.sizes), self.longest), self.slots, dtype=torch.long)
        for r, (h, w) in enumerate(self.sizes):
            rows = torch.arange(h // patch)[:, None] * gw + torch.arange(w // patch)[None, :]
            index[r, : self.tokens[r]] = rows.reshape(-1)
        self.index = index
        self.mask = torch.arange(self.longest)[None, :] < torch.tensor(self.tokens)[:, None]
        self._on: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def _index(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        key = str(device)
        if key not in self._on:
            gather = self.index.clamp(max=self.slots - 1).to(device)  # padded tokens read slot 0.. any real one
            self._on[key] = (gather, self.index.to(device))
        return self._on[key]

    def to_strip(self, latents: torch.Tensor) -> torch.Tensor:
        """(rows, C, H, W) padded latents -> (rows, C, p, L_max * p): each row's patches in
        raster order, one patch tall (what the stock patch embedding turns into its tokens)."""
        n, c, _, _ = latents.shape
        p, (gh, gw) = self.patch, (self.grid[0] // self.patch, self.grid[1] // self.patch)
        patches = latents.reshape(n, c, gh, p, gw, p).permute(0, 2, 4, 1, 3, 5).reshape(n, gh * gw, c * p * p)
        gather, _ = self._index(latents.device)
        picked = torch.gather(patches, 1, gather[:, :, None].expand(-1, -1, c * p * p))
        return picked.reshape(n, self.longest, c, p, p).permute(0, 2, 3, 1, 4).reshape(n, c, p, self.longest * p)

    def from_strip(self, strip: torch.Tensor) -> torch.Tensor:
        """(rows, C, p, L_max * p) strip prediction -> (rows, C, H, W), zeros outside each
        row's own region."""
        n, c = strip.shape[:2]
        p, (gh, gw) = self.patch, (self.grid[0] // self.patch, self.grid[1] // self.patch)
        tokens = strip.reshape(n, c, p, self.longest, p).permute(0, 3, 1, 2, 4).reshape(n, self.longest, c * p * p)
        _, scatter = self._index(strip.device)
        grid = strip.new_zeros(n, self.slots + 1, c * p * p)
        grid.scatter_(1, scatter[:, :, None].expand(-1, -1, c * p * p), tokens)
        grid = grid[:, : self.slots].reshape(n, gh, gw, c, p, p).permute(0, 3, 1, 4, 2, 5)
        return grid.reshape(n, c, gh * p, gw * p)


def strip_layout(rows: RowData, grid: tuple[int, int], patch: int) -> TokenLayout | None:
    """The `TokenLayout` of a forward whose latents have spatial size `grid`, or None when
    every row has that size (the stock layout; nothing to do). Memoised on `rows` (so once per
    batch composition)."""
    sizes = rows.get(LATENT_SIZE) if rows else None
    if not sizes or all(s == grid for s in sizes):
        return None
    return rows.derived(("token_layout", tuple(grid), patch), lambda: TokenLayout(sizes, grid, patch))


def strip_positions(longest: int, table: Callable[[int, int], torch.Tensor], dtype: torch.dtype,
                    device: torch.device) -> torch.Tensor:
    """(rows, L_max, D) each row of the forward running now its own position embedding
    (``table(h, w) -> (1, h/p * w/p, D)`` for its `LATENT_SIZE`, e.g. SD3's cropped sin-cos
    grid: what its solo forward adds) on its tokens, zeros on the padding; memoised per
    forward layout."""
    rows = current_rows()
    sizes = rows[LATENT_SIZE]

    def build() -> torch.Tensor:
        per_size = {s: table(*s) for s in set(sizes)}
        per_size = {s: t.reshape(-1, t.shape[-1]) for s, t in per_size.items()}
        out = torch.zeros(len(sizes), longest, next(iter(per_size.values())).shape[-1], dtype=dtype, device=device)
        for r, s in enumerate(sizes):
            out[r, : per_size[s].shape[0]] = per_size[s].to(device, dtype)
        return out

    return rows.derived(("positions", longest, dtype, str(device)), build)


def is_strip(spatial: tuple[int, int]) -> bool:
    """Whether a forward's latents of spatial size `spatial` are a `TokenLayout` strip: the
    forward running now carries token spans and some row's own size differs from it."""
    rows = current_rows()
    if rows is NO_ROW_DATA:
        return False
    sizes = rows.get(LATENT_SIZE)
    return bool(sizes) and rows.derived(("strip", spatial), lambda: any(s != spatial for s in sizes))


@torch.compiler.disable  # eager: memoised per layout, no guards on the row data in compiled blocks
def key_padding_mask(num_image: int, device: torch.device, rows: RowData | None = None,
                     tokens: str = IMAGE_TOKENS) -> torch.Tensor | None:
    """(rows, num_image) bool mask of the real tokens of one padded segment (each row's first
    ``rows[tokens]``: `IMAGE_TOKENS` for the noisy image tokens, `REFERENCE_TOKENS` for an edit's
    reference tokens) of the forward running now (`row_data.current_rows`, or `rows` when given),
    or None when no row is padded (every row has `num_image` tokens, or the forward carries no
    such row data). Memoised per forward layout."""
    rows = current_rows() if rows is None else rows
    if rows is NO_ROW_DATA:
        return None

    def build() -> torch.Tensor | None:
        counts = rows.get(tokens)
        if not counts or all(t == num_image for t in counts):
            return None
        return (torch.arange(num_image)[None, :] < torch.tensor(counts)[:, None]).to(device)

    return rows.derived(("key_mask", num_image, str(device), tokens), build)  # once per forward layout


@torch.compiler.disable  # eager: memoised per layout, no guards on the row data in compiled blocks
def image_key_mask(longest: int, reference: int, device: torch.device,
                   rows: RowData | None = None) -> torch.Tensor | None:
    """(rows, longest + reference) bool mask of the real image keys of a forward whose image
    sequence is ``[noisy (longest = L_max) | reference (R_max)]`` (`key_padding_mask` of each
    segment, True on a segment nobody pads), or None when neither segment is padded. Rows: the
    forward running now (or `rows`). Memoised per forward layout."""
    rows = current_rows() if rows is None else rows
    noisy = key_padding_mask(longest, device, rows)
    ref = key_padding_mask(reference, device, rows, REFERENCE_TOKENS) if reference else None
    if ref is None and (noisy is None or not reference):
        return noisy

    def build() -> torch.Tensor:
        n = rows.num_rows

        def real(mask: torch.Tensor | None, length: int) -> torch.Tensor:
            return mask if mask is not None else torch.ones(n, length, dtype=torch.bool, device=device)

        return torch.cat([real(noisy, longest), real(ref, reference)], dim=1)

    return rows.derived(("image_key_mask", longest, reference, str(device)), build)


def sizes_differ(rows: RowData) -> bool:
    """Whether the rows of a forward (its `RowData`) have different `LATENT_SIZE` (or, for
    edits, `REFERENCE_SIZE`) values: the forward needs per-row positions even when their token
    counts are equal (e.g. 32x64 and 64x32 pack to the same sequence length)."""
    if not rows:
        return False

    def differ() -> bool:
        return any(len(set(rows.get(key) or ())) > 1 for key in (LATENT_SIZE, REFERENCE_SIZE))

    return rows.derived(("sizes_differ",), differ)


def latent_rows(rows: RowData, num_latent_rows: int) -> RowData:
    """The row data of a forward's first `num_latent_rows` rows: one guidance branch, i.e. the
    rows of the guided prediction and of the latents (memoised on `rows`)."""
    if not rows:
        return rows
    return rows.derived(("latent_rows", num_latent_rows), lambda: rows.select(range(num_latent_rows)))


def zero_padded_tokens(x: torch.Tensor, longest: int, rows: RowData | None = None, reference: int = 0) -> torch.Tensor:
    """`x` (rows, N, ...) with each row's padded image tokens among its first `longest` (and,
    with `reference` = R_max, its padded reference tokens among the next `reference`) set to
    zero (the rest of the sequence unchanged), for packed-token families whose image tokens come
    first in `x`: the prediction of padded tokens (so padded latents stay zero), or a modulated
    input whose statistics must be each row's own. `x` itself when nothing is padded. Rows: the
    forward running now (or `rows`; `latent_rows` for a guided prediction)."""
    mask = image_key_mask(longest, reference, x.device, rows)
    if mask is None:
        return x
    span = mask.shape[1]
    mask = mask.reshape(*mask.shape, *([1] * (x.dim() - 2)))
    head = x[:, :span].masked_fill(~mask, 0)
    return head if x.shape[1] == span else torch.cat([head, x[:, span:]], dim=1)


def zero_padded_spans(x: torch.Tensor, spans: Any) -> torch.Tensor:
    """`zero_padded_tokens` of `x` (rows, N_img, ...) at a packed family's forward ``spans``
    (anything with ``longest`` and ``reference``: Flux's, Qwen-Image's; None: `x` itself, a
    forward whose rows share one size). What TeaCache's forward split hands on in a mixed
    forward, so the means TeaCache and its guard take of a row (relative changes, errors,
    forecasts) are its solo run's; nobody reads the padded tokens otherwise (masked keys, the
    guided prediction's padded tokens zeroed after guidance)."""
    return x if spans is None else zero_padded_tokens(x, spans.longest, reference=spans.reference)


@torch.compiler.disable  # eager: memoised per layout, no guards on the row data in compiled blocks
def attention_bias(num_image: int, num_keys: int, dtype: torch.dtype, device: torch.device,
                   fold_count: int | None = None, image_start: int = 0, reference: int = 0) -> torch.Tensor | None:
    """(rows, 1, 1, num_keys) additive attention bias of a joint attention whose keys
    ``image_start : image_start + num_image`` are the padded image tokens (SD3: image first,
    context after; Flux: text first, ``image_start`` = the text length) and, for edits, the next
    `reference` keys the padded reference tokens (Kontext): -inf on the padded image and
    reference keys of the forward running now (`image_key_mask`), plus ``log(fold_count)`` on
    the last key when given (`sd3.context_folding`). None when no row is padded. Memoised per
    forward layout (built once, read by every block)."""
    mask = image_key_mask(num_image, reference, device)
    if mask is None:
        return None

    def build() -> torch.Tensor:
        bias = torch.zeros(mask.shape[0], 1, 1, num_keys, dtype=dtype, device=device)
        bias[:, 0, 0, image_start:image_start + mask.shape[1]].masked_fill_(~mask, float("-inf"))
        if fold_count is not None:
            bias[..., -1] += math.log(fold_count)
        return bias

    key = ("bias", num_image, num_keys, dtype, str(device), fold_count, image_start, reference)
    return current_rows().derived(key, build)


__all__ = ["IMAGE_TOKENS", "LATENT_SIZE", "REFERENCE_SIZE", "REFERENCE_TOKENS", "TokenLayout", "attention_bias",
           "image_key_mask", "is_strip", "key_padding_mask", "latent_rows", "sizes_differ", "strip_layout",
           "strip_positions", "zero_padded_tokens"]
