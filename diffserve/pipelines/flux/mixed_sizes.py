"""Mixed sizes in one FLUX.1 forward (`diffserve.pipelines.token_spans`): each row its own RoPE
positions and attention span (also Kontext's transformer).

Flux's latents are packed token sequences (N, L, 4C), one token per 2x2 latent patch in raster
order, so a request's rows already are what its solo forward sees: collation right-pads each
request's sequence with zero tokens to the batch's longest, ``L_max`` (`step_batch.pad_latents`),
and no strip is needed. What differs per row is the rotary position table: diffusers'
`FluxTransformer2DModel` builds ONE table from ``cat(txt_ids, img_ids)`` for the whole forward.
`install_token_spans` puts a `SpanFluxAttnProcessor` on every attention (double- and
single-stream blocks); in a forward whose ``joint_attention_kwargs`` hold ``spans`` (a
`FluxSpans`, set by the adapter only when the rows' sizes differ) it

- rotates each row's queries and keys by its own table (`RowRotary`: diffusers' `FluxPosEmbed`
  on the ids ``(0, row, col)`` of its own latent grid and, for Kontext, ``(1, row, col)`` of its
  own reference grid, what its solo forward uses, stacked to (rows, S, D); the text keeps the
  forward's shared table), and
- masks each row's padded image and reference keys (`token_spans.attention_bias`, the keys
  after the text).

The joint sequence is ``[text (N_txt) | noisy image (L_max, row r real on its first n_r) |
reference (Kontext: R_max, row r real on its first m_r)]`` in both block kinds (collation pads
both segments, `PipelineAdapter.appended_latents`). Padded queries compute values nobody reads
(the adapter zeroes their guided prediction); no real row attends to them, so every row equals its solo
forward within float rounding. In a forward without ``spans`` the processor runs diffusers'
`FluxAttnProcessor` unchanged.

In an eager forward both block kinds go one step further (`diffserve.pipelines.length_groups`,
`_grouped_block_forward`): each block runs once per row size, on that size's real tokens only
(Kontext: per pair of noisy and reference token counts, the group's noisy then reference
tokens), with a `FluxSpans` of the group's own lengths, so the processor builds each row's
tables at that length and no mask (nothing is padded inside a group); the layout between blocks
stays the padded one. A compiled block or a CUDA graph capture keeps the masked padded path.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from diffusers import FluxPipeline
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.transformers.transformer_flux import (
    FluxAttention,
    FluxAttnProcessor,
    FluxPosEmbed,
    _get_qkv_projections,
)

from diffserve.pipelines.length_groups import (
    gather_rows,
    gather_segments,
    length_groups,
    scatter_rows,
    scatter_segments,
)
from diffserve.pipelines.row_data import NO_ROW_DATA, current_rows, narrowed_rows
from diffserve.pipelines.token_spans import (
    IMAGE_TOKENS,
    LATENT_SIZE,
    REFERENCE_SIZE,
    REFERENCE_TOKENS,
    attention_bias,
    sizes_differ,
)

if TYPE_CHECKING:
    from diffserve.pipelines.request_state import RequestState
    from diffserve.pipelines.step_batch import StepBatch

#: 2x2 latent patches per token (Flux's packing).
PATCH = 2


@dataclass(frozen=True)
class FluxSpans:
    """Layout of a forward over rows of different sizes (``joint_attention_kwargs["spans"]``).

    Attributes:
        text: N_txt, the text tokens before the image tokens in the joint sequence.
        longest: L_max, the padded noisy-image token count (row r's real tokens are its first
            ``(h_r/2) * (w_r/2)``; row data `token_spans.IMAGE_TOKENS`).
        ids_dtype: the dtype of the position ids diffusers builds (the prompt embeddings'),
            so each row's ids round as in its solo run.
        reference: R_max, the padded reference token count after the noisy ones (Kontext; row
            r's real ones are its first `token_spans.REFERENCE_TOKENS`); 0 without a reference.
    """

    text: int
    longest: int
    ids_dtype: torch.dtype
    reference: int = 0


class RowRotary:
    """Per-row rotary tables of a mixed forward, from each row's `token_spans.LATENT_SIZE`.

    Args:
        theta: `FluxPosEmbed`'s base (the transformer's, 10000).
        axes_dim: `FluxPosEmbed`'s per-axis dims (e.g. (16, 56, 56); sum = head_dim D).
    """

    #: grids whose image tables are kept (per dtype and device)
    MAX_GRIDS = 64

    def __init__(self, theta: int, axes_dim: tuple[int, ...]):
        self.pos_embed = FluxPosEmbed(theta=theta, axes_dim=list(axes_dim))
        self._grids: OrderedDict[tuple, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()

    def image_table(self, latent_size: tuple[int, int], ids_dtype: torch.dtype,
                    device: torch.device, first_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each (h/2 * w/2, D) float32: the table of a solo forward's image tokens
        for latents of `latent_size` (h, w) (ids from diffusers' ``_prepare_latent_image_ids``,
        first coordinate `first_id`: 0 noisy latents, 1 Kontext's reference, as its
        ``prepare_latents``)."""
        key = (tuple(latent_size), ids_dtype, str(device), first_id)
        hit = self._grids.get(key)
        if hit is None:
            h, w = latent_size
            ids = FluxPipeline._prepare_latent_image_ids(None, h // PATCH, w // PATCH, device, ids_dtype)
            ids[..., 0] = first_id
            hit = self._grids[key] = self.pos_embed(ids)
            while len(self._grids) > self.MAX_GRIDS:
                self._grids.popitem(last=False)
        return hit

    @torch.compiler.disable  # eager, outside a compiled block: built once per layout, no guards on the memo
    def tables(self, spans: FluxSpans, shared: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each (rows, S, D) float32, for the rows of the forward running now
        (`row_data.current_rows`): the shared (S, D) table (text) with each row's own image table
        on its noisy tokens, its own reference table on its reference tokens (Kontext), and the
        identity rotation (cos 1, sin 0) on its padding. Memoised per forward layout (built by
        the first block, read by the others).

        Raises:
            ValueError: the forward carries no per-row `LATENT_SIZE` (only the adapter sets
                ``spans``, together with the row data).
        """
        rows = current_rows()
        if rows is NO_ROW_DATA or LATENT_SIZE not in rows:
            raise ValueError("a Flux forward with token spans needs each row's latent_size as row data")
        cos, sin = shared

        def build() -> tuple[torch.Tensor, torch.Tensor]:
            n = rows.num_rows
            start, ref_start = spans.text, spans.text + spans.longest
            out_cos, out_sin = cos.expand(n, -1, -1).clone(), sin.expand(n, -1, -1).clone()
            references = rows.get(REFERENCE_SIZE) if spans.reference else None
            segments = [(start, spans.longest, rows[LATENT_SIZE], 0)]
            if references:
                segments.append((ref_start, spans.reference, references, 1))
            for first, length, sizes, first_id in segments:
                out_cos[:, first:first + length] = 1.0
                out_sin[:, first:first + length] = 0.0
                for r, size in enumerate(sizes):
                    row_cos, row_sin = self.image_table(size, spans.ids_dtype, cos.device, first_id)
                    out_cos[r, first:first + row_cos.shape[0]] = row_cos
                    out_sin[r, first:first + row_sin.shape[0]] = row_sin
            return out_cos, out_sin

        return rows.derived(("flux_rotary", spans, cos.shape[0], str(cos.device)), build)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """diffusers' ``apply_rotary_emb`` (``use_real``, pairs interleaved, sequence dim 1) with a
    table per row: x (B, S, H, D) any float dtype, cos / sin (B, S, D) float32; returns x's
    shape and dtype (the same arithmetic as diffusers' shared-table rotation)."""
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    x_real, x_imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    x_rotated = torch.stack([-x_imag, x_real], dim=-1).flatten(3)
    return (x.float() * cos + x_rotated.float() * sin).to(x.dtype)


class SpanFluxAttnProcessor(FluxAttnProcessor):
    """diffusers' `FluxAttnProcessor` (0.42) that, in a forward with ``spans`` (`FluxSpans`),
    rotates each row by its own table (`RowRotary.tables`) and masks each row's padded image
    keys; the stock processor otherwise.

    Tensors: hidden_states (B, N, C) (single-stream blocks: text then image tokens),
    encoder_hidden_states (B, N_txt, C) or None, image_rotary_emb the forward's shared (cos, sin)
    (S, D); returns what `FluxAttnProcessor` returns.

    Raises:
        ValueError: an ``attention_mask`` together with ``spans`` (the Flux transformer never
            passes one).
    """

    def __init__(self, rotary: RowRotary):
        super().__init__()
        self.rotary = rotary

    def __call__(self, attn: FluxAttention, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor = None,
                 attention_mask: torch.Tensor | None = None, image_rotary_emb=None, spans: FluxSpans | None = None):
        if spans is None or image_rotary_emb is None:
            return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)
        if attention_mask is not None:
            raise ValueError("attention_mask cannot be combined with token spans")
        query, key, value, encoder_query, encoder_key, encoder_value = _get_qkv_projections(
            attn, hidden_states, encoder_hidden_states)
        query = attn.norm_q(query.unflatten(-1, (-1, attn.head_dim)))
        key = attn.norm_k(key.unflatten(-1, (-1, attn.head_dim)))
        value = value.unflatten(-1, (-1, attn.head_dim))
        if attn.added_kv_proj_dim is not None:
            encoder_query = attn.norm_added_q(encoder_query.unflatten(-1, (-1, attn.head_dim)))
            encoder_key = attn.norm_added_k(encoder_key.unflatten(-1, (-1, attn.head_dim)))
            encoder_value = encoder_value.unflatten(-1, (-1, attn.head_dim))
            query = torch.cat([encoder_query, query], dim=1)
            key = torch.cat([encoder_key, key], dim=1)
            value = torch.cat([encoder_value, value], dim=1)
        cos, sin = self.rotary.tables(spans, image_rotary_emb)
        query, key = rotate(query, cos, sin), rotate(key, cos, sin)
        bias = attention_bias(spans.longest, key.shape[1], query.dtype, query.device, image_start=spans.text,
                              reference=spans.reference)
        out = dispatch_attention_fn(query, key, value, attn_mask=bias, backend=self._attention_backend,
                                    parallel_config=self._parallel_config)
        out = out.flatten(2, 3).to(query.dtype)
        if encoder_hidden_states is None:
            return out
        n_txt = encoder_hidden_states.shape[1]
        encoder_out, out = out.split_with_sizes([n_txt, out.shape[1] - n_txt], dim=1)
        out = attn.to_out[1](attn.to_out[0](out.contiguous()))
        return out, attn.to_add_out(encoder_out.contiguous())


def _grouped_block_forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                           temb: torch.Tensor, image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
                           joint_attention_kwargs: dict[str, Any] | None = None, *, grouped: Callable[[], bool]):
    """`FluxTransformerBlock.forward` / `FluxSingleTransformerBlock.forward` (diffusers 0.42:
    both take these arguments and return ``(encoder_hidden_states, hidden_states)``) that, in an
    eager forward over rows of different sizes (``spans`` set, `length_groups.length_groups`
    not None), runs the stock block once per row size on the group's real tokens only.

    Per group (g rows of n noisy and, for Kontext, m reference tokens): hidden_states
    ``cat([rows, :n], [rows, L_max : L_max + m])`` of (B, L_max + R_max, D) -> (g, n + m, D),
    encoder_hidden_states (B, N_txt, D) and temb (B, D) ``[rows]``, image_rotary_emb the
    shared table's first ``N_txt + n + m`` entries (the processor replaces every entry after the
    text by each row's own, `RowRotary.tables`) and ``spans`` with ``longest=n, reference=m``
    (no row padded: no mask), with the forward context narrowed to the group. Returns
    ``(encoder_hidden_states, hidden_states)`` of the input shapes, hidden_states zero on padded
    tokens. `grouped()` False (the adapter's `PipelineAdapter.length_groups`), no ``spans``,
    or a compiled block: the stock block over the padded rows."""
    stock = type(self).forward
    spans = joint_attention_kwargs.get("spans") if joint_attention_kwargs else None
    groups = length_groups(spans.longest, hidden_states.device, reference=spans.reference) \
        if spans is not None and image_rotary_emb is not None and grouped() else None
    if groups is None:
        return stock(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb, joint_attention_kwargs)
    longest = spans.longest
    cos, sin = image_rotary_emb
    out_hidden = hidden_states.new_zeros(hidden_states.shape)
    out_context = encoder_hidden_states.new_empty(encoder_hidden_states.shape)
    for group in groups:
        n, m = group.tokens, group.reference
        hidden = gather_segments(hidden_states, group, longest)
        size = spans.text + n + m
        kwargs = {**joint_attention_kwargs, "spans": dataclasses.replace(spans, longest=n, reference=m)}
        with narrowed_rows(group.members):
            context, hidden = stock(self, hidden, gather_rows(encoder_hidden_states, group), gather_rows(temb, group),
                                    (cos[:size], sin[:size]), kwargs)
        scatter_rows(out_context, group, context)
        scatter_segments(out_hidden, group, hidden, longest)
    return out_context, out_hidden


def install_token_spans(transformer: torch.nn.Module, grouped: Callable[[], bool] = lambda: True) -> bool:
    """Put a `SpanFluxAttnProcessor` (sharing one `RowRotary`) on every attention of a
    `FluxTransformer2DModel` and `_grouped_block_forward` on every double- and single-stream
    block (instance attributes: weights and state dict unchanged; stock behaviour outside
    forwards with ``spans``; per row size in eager mixed forwards while `grouped()` says so).
    Returns True (the transformer can mix sizes)."""
    embed = transformer.pos_embed
    rotary = RowRotary(embed.theta, tuple(embed.axes_dim))
    for module in transformer.modules():
        if isinstance(module, FluxAttention):
            module.set_processor(SpanFluxAttnProcessor(rotary))
    for block in (*transformer.transformer_blocks, *transformer.single_transformer_blocks):
        block.forward = types.MethodType(functools.partial(_grouped_block_forward, grouped=grouped), block)
    return True


def set_token_span(state: "RequestState", vae_scale_factor: int, enabled: bool,
                   reference: tuple[int, int] | None = None, reference_tokens: int = 0) -> None:
    """When `enabled` (the adapter's `mixed_sizes`): the request's latent size (h, w) in latent
    pixels (what diffusers' ``prepare_latents`` unpacks its ``height`` x ``width`` to) and its
    image-token count (its packed latents' sequence length) as row data (`token_spans`); for
    Kontext also its `reference` image's size (height, width) in pixels as a latent size and
    its `reference_tokens` (the packed reference's sequence length)."""
    if enabled:
        p, multiple = state.params, vae_scale_factor * PATCH
        state.row_data[LATENT_SIZE] = (PATCH * (p.height // multiple), PATCH * (p.width // multiple))
        state.row_data[IMAGE_TOKENS] = state.latents.shape[1]
        if reference is not None:
            state.row_data[REFERENCE_SIZE] = (PATCH * (reference[0] // multiple), PATCH * (reference[1] // multiple))
            state.row_data[REFERENCE_TOKENS] = reference_tokens


def span_inputs(batch: "StepBatch", inputs: dict[str, Any]) -> dict[str, Any]:
    """The forward's keyword arguments `inputs` for `batch`; when its rows have different latent
    or reference sizes (`token_spans.sizes_differ`) also ``spans`` (`FluxSpans`) in
    ``joint_attention_kwargs`` and the first request's ``img_ids`` padded to the forward's
    ``[L_max | R_max]`` image sequence (zero ids after its noisy ids and after Kontext's
    reference ids: the processors give each row its own)."""
    if not sizes_differ(batch.row_data):
        return inputs
    img_ids = inputs["img_ids"]
    longest = batch.latents.shape[1]
    spans = FluxSpans(text=inputs["txt_ids"].shape[0], longest=longest, ids_dtype=img_ids.dtype,
                      reference=inputs["hidden_states"].shape[1] - longest)
    first = batch.states[0].row_data[IMAGE_TOKENS]
    first_reference = img_ids.shape[0] - first

    def padded_ids() -> torch.Tensor:
        def pad(n: int) -> torch.Tensor:
            return img_ids.new_zeros(n, img_ids.shape[1])

        return torch.cat([img_ids[:first], pad(spans.longest - first), img_ids[first:],
                          pad(spans.reference - first_reference)])

    key = ("flux_img_ids", spans.longest, spans.reference, str(img_ids.device))
    return {**inputs, "img_ids": batch.row_data.derived(key, padded_ids),
            "joint_attention_kwargs": {**(inputs.get("joint_attention_kwargs") or {}), "spans": spans}}


__all__ = ["FluxSpans", "RowRotary", "SpanFluxAttnProcessor", "install_token_spans", "rotate", "set_token_span",
           "span_inputs"]
