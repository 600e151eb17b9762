"""Mixed sizes in one Qwen-Image forward (`diffserve.pipelines.token_spans`): each row its own
RoPE positions (image and text) and attention span (also Qwen-Image-Edit's transformer, whose
rows hold a target and a reference image).

Qwen-Image's latents are packed token sequences (N, L, 4C) like Flux's: collation right-pads
each request's sequence to the batch's longest, ``L_max``. diffusers' `QwenEmbedRope` builds ONE
pair of tables per forward from the first row's ``img_shapes``: the image table of its latent
grids (Qwen-Image-Edit: the target's at frame index 0, then the reference's at frame index 1)
and the text table, which starts at the largest ``max(h/2, w/2)`` of those grids
(``scale_rope``), so BOTH depend on a row's sizes. `install_token_spans` puts a
`SpanQwenAttnProcessor` on every joint attention; in a forward whose ``attention_kwargs`` hold
``spans`` (a `QwenSpans`, set by the adapter only when the rows' sizes differ) it

- rotates each row's image queries/keys by its own tables (`RowRotary`: `QwenEmbedRope.forward`
  over that row's own ``img_shapes``, target then reference segment, identity on the padding)
  and its text queries/keys by the text table at its own offset, and
- masks each row's padded target and reference keys, together with the padded text keys the
  batch's text padding already masks (``encoder_hidden_states_mask``).

The joint sequence is ``[text (N_txt, padded per row) | target (L_max, row r real on its first
n_r) | reference (edits: R_max, row r real on its first m_r)]``. Padded queries compute values
nobody reads (the adapter zeroes their guided prediction and drops the reference's), so every
row equals its solo forward within float rounding. In a forward without ``spans`` the processor
runs diffusers' `QwenDoubleStreamAttnProcessor2_0` unchanged.

In an eager forward every `QwenImageTransformerBlock` goes one step further
(`diffserve.pipelines.length_groups`, `_grouped_block_forward`): it runs once per row size on
that size's real tokens only (edits: per pair of target and reference token counts, the group's
target then reference tokens), with a `QwenSpans` of the group's own lengths, so the processor
builds each row's tables at that length and masks no image key; the layout between blocks stays
the padded one. Texts are right-padded per row too (``encoder_hidden_states_mask``), so a group
is the rows of one (target, reference, text) token count triple (`text_groups`) and gets its
text cut to that length and no mask: each group computes exactly its rows' solo forward (rows of
equal image size but different text lengths run apart; with one text length, e.g. one negative
prompt, they share). A compiled block or a CUDA
graph capture keeps the masked padded path. Transformers with ``zero_cond_t`` (per-token
``modulate_index``, Qwen-Image-Edit-2511) or ``use_additional_t_cond`` never mix sizes (see
`install_token_spans`), so they never group either.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.transformers.transformer_qwenimage import QwenDoubleStreamAttnProcessor2_0

from diffserve.pipelines.length_groups import (
    LengthGroup,
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
    image_key_mask,
    sizes_differ,
)

if TYPE_CHECKING:
    from diffserve.pipelines.request_state import RequestState
    from diffserve.pipelines.step_batch import StepBatch

#: 2x2 latent patches per token (Qwen-Image's packing).
PATCH = 2


@dataclass(frozen=True)
class QwenSpans:
    """Layout of a forward over rows of different sizes (``attention_kwargs["spans"]``).

    Attributes:
        longest: L_max, the padded image-token count (row r's real tokens are its first
            ``(h_r/2) * (w_r/2)``; row data `token_spans.IMAGE_TOKENS`).
        reference: R_max, the padded reference-token count after them (Qwen-Image-Edit; row
            r's real ones are its first `token_spans.REFERENCE_TOKENS`); 0 without a reference.
    """

    longest: int
    reference: int = 0


class RowRotary:
    """Per-row complex RoPE tables of a mixed forward, from each row's `token_spans.LATENT_SIZE`.

    Args:
        pos_embed: the transformer's `QwenEmbedRope` (its frequency tables and ``scale_rope``).
    """

    def __init__(self, pos_embed: torch.nn.Module):
        self.pos_embed = pos_embed

    @torch.compiler.disable  # eager, outside a compiled block: built once per layout, no guards on the memo
    def tables(self, num_text: int, spans: QwenSpans, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(image (rows, L_max + R_max, D/2), text (rows, N_txt, D/2)) complex64 tables of the
        rows of the forward running now: what each row's solo forward uses (`QwenEmbedRope.forward`
        over its own ``img_shapes``: its target grid and, for edits, its reference grid), the
        target's on its first tokens, the reference's from L_max on, 1 (no rotation) on padded
        tokens. Memoised per forward layout.

        Raises:
            ValueError: the forward carries no per-row `LATENT_SIZE`.
        """
        rows = current_rows()
        if rows is NO_ROW_DATA or LATENT_SIZE not in rows:
            raise ValueError("a Qwen-Image forward with token spans needs each row's latent_size as row data")

        def build() -> tuple[torch.Tensor, torch.Tensor]:
            embed = self.pos_embed
            pos, _ = embed._get_device_freqs(device)
            n, longest = rows.num_rows, spans.longest
            references = rows.get(REFERENCE_SIZE) if spans.reference else None
            image = torch.ones(n, longest + spans.reference, pos.shape[1], dtype=pos.dtype, device=device)
            text = torch.empty(n, num_text, pos.shape[1], dtype=pos.dtype, device=device)
            for r, (h, w) in enumerate(rows[LATENT_SIZE]):
                shapes = [(1, h // PATCH, w // PATCH)]
                if references:
                    ref_h, ref_w = references[r]
                    shapes.append((1, ref_h // PATCH, ref_w // PATCH))
                freqs, text[r] = embed([shapes], device=device, max_txt_seq_len=num_text)
                target = shapes[0][1] * shapes[0][2]
                image[r, :target] = freqs[:target]
                image[r, longest:longest + freqs.shape[0] - target] = freqs[target:]
            return image, text

        return rows.derived(("qwen_rotary", num_text, spans, str(device)), build)


def rotate(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """diffusers' ``apply_rotary_emb_qwen`` (complex, ``use_real=False``) with a table per row:
    x (B, S, H, D) any float dtype, freqs (B, S, D/2) complex; returns x's shape and dtype."""
    x_complex = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(x_complex * freqs.unsqueeze(2)).flatten(3).type_as(x)


class SpanQwenAttnProcessor(QwenDoubleStreamAttnProcessor2_0):
    """diffusers' `QwenDoubleStreamAttnProcessor2_0` (0.42) that, in a forward with ``spans``
    (`QwenSpans`), rotates each row by its own tables (`RowRotary.tables`) and masks each row's
    padded image keys; the stock processor otherwise.

    Tensors: hidden_states (B, L_max + R_max, C) image stream (target then reference tokens,
    R_max = 0 without a reference), encoder_hidden_states (B, N_txt, C) text
    stream, encoder_hidden_states_mask (B, N_txt) bool or None; returns (image, text) outputs of
    the same shapes.

    Raises:
        ValueError: no text stream, or an ``attention_mask`` (as the stock processor).
    """

    def __init__(self, rotary: RowRotary):
        super().__init__()
        self.rotary = rotary

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor = None,
                 encoder_hidden_states_mask: torch.Tensor = None, attention_mask: torch.Tensor | None = None,
                 image_rotary_emb=None, spans: QwenSpans | None = None):
        if spans is None or encoder_hidden_states is None or attention_mask is not None:
            return super().__call__(attn, hidden_states, encoder_hidden_states, encoder_hidden_states_mask,
                                    attention_mask, image_rotary_emb)
        n_txt = encoder_hidden_states.shape[1]
        head_dim = attn.inner_dim // attn.heads

        def heads(x: torch.Tensor) -> torch.Tensor:
            return x.unflatten(-1, (-1, head_dim))

        img_query, img_key, img_value = (heads(attn.to_q(hidden_states)), heads(attn.to_k(hidden_states)),
                                         heads(attn.to_v(hidden_states)))
        txt_query = heads(attn.add_q_proj(encoder_hidden_states))
        txt_key = heads(attn.add_k_proj(encoder_hidden_states))
        txt_value = heads(attn.add_v_proj(encoder_hidden_states))
        if attn.norm_q is not None:
            img_query = attn.norm_q(img_query)
        if attn.norm_k is not None:
            img_key = attn.norm_k(img_key)
        if attn.norm_added_q is not None:
            txt_query = attn.norm_added_q(txt_query)
        if attn.norm_added_k is not None:
            txt_key = attn.norm_added_k(txt_key)
        img_freqs, txt_freqs = self.rotary.tables(n_txt, spans, hidden_states.device)
        img_query, img_key = rotate(img_query, img_freqs), rotate(img_key, img_freqs)
        txt_query, txt_key = rotate(txt_query, txt_freqs), rotate(txt_key, txt_freqs)
        image_mask = image_key_mask(spans.longest, spans.reference, hidden_states.device)
        mask = None
        if image_mask is not None or encoder_hidden_states_mask is not None:
            rows, num_image = hidden_states.shape[:2]
            if image_mask is None:
                image_mask = torch.ones(rows, num_image, dtype=torch.bool, device=hidden_states.device)
            text_mask = (torch.ones(rows, n_txt, dtype=torch.bool, device=hidden_states.device)
                         if encoder_hidden_states_mask is None else encoder_hidden_states_mask.bool())
            mask = torch.cat([text_mask, image_mask], dim=1)[:, None, None, :]
        out = dispatch_attention_fn(torch.cat([txt_query, img_query], dim=1), torch.cat([txt_key, img_key], dim=1),
                                    torch.cat([txt_value, img_value], dim=1), attn_mask=mask, dropout_p=0.0,
                                    is_causal=False, backend=self._attention_backend,
                                    parallel_config=self._parallel_config)
        out = out.flatten(2, 3).to(img_query.dtype)
        txt_out, img_out = out[:, :n_txt], out[:, n_txt:]
        img_out = attn.to_out[0](img_out.contiguous())
        if len(attn.to_out) > 1:
            img_out = attn.to_out[1](img_out)
        return img_out, attn.to_add_out(txt_out.contiguous())


def text_groups(groups: tuple[LengthGroup, ...], text_mask: torch.Tensor | None,
                num_text: int) -> tuple[tuple[LengthGroup, int], ...] | None:
    """`groups` (of the forward running now) split by each row's real text token count.

    Args:
        groups: the forward's `length_groups.length_groups`.
        text_mask: (B, N_txt) bool ``encoder_hidden_states_mask`` (True on real text tokens,
            collation right-pads: `step_batch.padding_mask`), or None (no text padded).
        num_text: N_txt.

    Returns:
        ``(group, t)`` pairs: the rows of one group with t real text tokens each (their first t),
        ascending by (tokens, reference, t); every row's t is N_txt without a mask. None when a
        row's mask is not a prefix (real tokens after a padded one): the caller keeps the mask.
        Memoised per forward layout (`RowData.derived`: one host read of the mask per batch
        composition, which also fixes the texts).
    """
    if text_mask is None:
        return tuple((group, num_text) for group in groups)
    rows = current_rows()

    def build() -> tuple[tuple[LengthGroup, int], ...] | None:
        mask = text_mask.bool().cpu()
        lengths = mask.sum(dim=1).tolist()
        if not all(bool(mask[r, :t].all()) for r, t in enumerate(lengths)):
            return None
        split = []
        for group in groups:
            for t in sorted({lengths[r] for r in group.members}):
                members = tuple(r for r in group.members if lengths[r] == t)
                index = group.rows if members == group.members else torch.tensor(members, dtype=torch.long,
                                                                                   device=group.rows.device)
                split.append((LengthGroup(members, index, group.tokens, group.reference), t))
        return tuple(split)

    layout = tuple((group.tokens, group.reference, group.members) for group in groups)
    return rows.derived(("qwen_text_groups", layout, num_text, str(text_mask.device)), build)


def _grouped_block_forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                           encoder_hidden_states_mask: torch.Tensor | None, temb: torch.Tensor,
                           image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
                           joint_attention_kwargs: dict[str, Any] | None = None,
                           modulate_index: list[int] | None = None, *, grouped: Callable[[], bool]):
    """`QwenImageTransformerBlock.forward` (diffusers 0.42.1: these arguments, returns
    ``(encoder_hidden_states, hidden_states)``) that, in an eager forward over rows of different
    sizes (``spans`` set, `length_groups.length_groups` not None), runs the stock block once per
    row size on the group's real tokens only.

    Per group (g rows of n target, for edits m reference and t real text tokens,
    `text_groups`): hidden_states ``cat([rows, :n], [rows, L_max : L_max + m])`` of
    (B, L_max + R_max, D) -> (g, n + m, D), encoder_hidden_states (B, N_txt, D) ``[rows, :t]``,
    temb (B, D) ``[rows]``, no text mask, image_rotary_emb as given (the processor replaces it
    by each row's own tables at these lengths, `RowRotary.tables`) and ``spans`` with
    ``longest=n, reference=m`` (no image key masked), with the forward context narrowed to the
    group: the stock computation of each row's solo forward. Returns ``(encoder_hidden_states,
    hidden_states)`` of the input shapes, zero on padded image and text tokens. `grouped()`
    False (the adapter's `PipelineAdapter.length_groups`), no ``spans``, a ``modulate_index``
    (``zero_cond_t``: never with ``spans``, `install_token_spans`) or a compiled block: the
    stock block over the padded rows. A text mask that is not a prefix per row (never from
    collation): groups by image counts only, each with its rows' full mask."""
    stock = type(self).forward
    spans = joint_attention_kwargs.get("spans") if joint_attention_kwargs else None
    groups = length_groups(spans.longest, hidden_states.device, reference=spans.reference) \
        if spans is not None and modulate_index is None and grouped() else None
    if groups is None:
        return stock(self, hidden_states, encoder_hidden_states, encoder_hidden_states_mask, temb, image_rotary_emb,
                     joint_attention_kwargs, modulate_index)
    num_text = encoder_hidden_states.shape[1]
    split = text_groups(groups, encoder_hidden_states_mask, num_text)
    masked = split is None
    if masked:
        split = tuple((group, num_text) for group in groups)
    longest = spans.longest
    out_hidden = hidden_states.new_zeros(hidden_states.shape)
    out_context = encoder_hidden_states.new_zeros(encoder_hidden_states.shape)
    for group, t in split:
        n, m = group.tokens, group.reference
        hidden = gather_segments(hidden_states, group, longest)
        mask = gather_rows(encoder_hidden_states_mask, group) if masked else None
        kwargs = {**joint_attention_kwargs, "spans": dataclasses.replace(spans, longest=n, reference=m)}
        with narrowed_rows(group.members):
            context, hidden = stock(self, hidden, gather_rows(encoder_hidden_states, group, t), mask,
                                    gather_rows(temb, group), image_rotary_emb, kwargs)
        scatter_rows(out_context, group, context)
        scatter_segments(out_hidden, group, hidden, longest)
    return out_context, out_hidden


def install_token_spans(transformer: torch.nn.Module, grouped: Callable[[], bool] = lambda: True) -> bool:
    """Put a `SpanQwenAttnProcessor` (sharing one `RowRotary`) on every joint attention of a
    `QwenImageTransformer2DModel` and `_grouped_block_forward` on every block (instance
    attributes: weights and state dict unchanged; stock behaviour outside forwards with
    ``spans``; per row size in eager mixed forwards while `grouped()` says so). Returns whether
    it did: not for transformers with ``zero_cond_t`` or ``use_additional_t_cond``, whose time
    modulation indexes tokens by the first row's ``img_shapes`` (they batch by size)."""
    config = transformer.config
    if config.get("zero_cond_t") or config.get("use_additional_t_cond"):
        return False
    rotary = RowRotary(transformer.pos_embed)
    for block in transformer.transformer_blocks:
        block.attn.set_processor(SpanQwenAttnProcessor(rotary))
        block.forward = types.MethodType(functools.partial(_grouped_block_forward, grouped=grouped), block)
    return True


def set_token_span(state: "RequestState", img_shape: tuple[int, int, int], enabled: bool,
                   reference: tuple[int, int, int] | None = None, reference_tokens: int = 0) -> None:
    """When `enabled` (the adapter's `mixed_sizes`): the request's latent size (h, w) in latent
    pixels (its ``img_shapes`` entry ``(1, h/2, w/2)`` in tokens) and its image-token count as
    row data (`token_spans`); for edits also its `reference` ``img_shapes`` entry as a latent
    size and its `reference_tokens`."""
    if enabled:
        state.row_data[LATENT_SIZE] = (PATCH * img_shape[1], PATCH * img_shape[2])
        state.row_data[IMAGE_TOKENS] = state.latents.shape[1]
        if reference is not None:
            state.row_data[REFERENCE_SIZE] = (PATCH * reference[1], PATCH * reference[2])
            state.row_data[REFERENCE_TOKENS] = reference_tokens


def span_inputs(batch: "StepBatch", inputs: dict[str, Any]) -> dict[str, Any]:
    """The forward's keyword arguments `inputs` for `batch`; when its rows have different latent
    (or reference) sizes (`token_spans.sizes_differ`) also ``spans`` (`QwenSpans`) in
    ``attention_kwargs`` and the first row's ``img_shapes`` for every row (diffusers builds one
    table from the first row anyway, and warns on a mixed list; the processors give each row
    its own)."""
    if not sizes_differ(batch.row_data):
        return inputs
    shapes = inputs["img_shapes"]
    longest = batch.latents.shape[1]
    spans = QwenSpans(longest=longest, reference=inputs["hidden_states"].shape[1] - longest)
    return {**inputs, "img_shapes": [shapes[0]] * len(shapes),
            "attention_kwargs": {**(inputs.get("attention_kwargs") or {}), "spans": spans}}


__all__ = ["QwenSpans", "RowRotary", "SpanQwenAttnProcessor", "install_token_spans", "rotate", "set_token_span",
           "span_inputs", "text_groups"]
