"""Length groups: a mixed-size forward's transformer blocks run once per row size, each on its
rows' real tokens only.

A forward over rows of different sizes (`token_spans`) pads every row's image tokens to the
longest, ``L_max``, and masks the padded keys. That is exact but not cheap when the forward is
compute-bound: every token-wise layer (q/k/v and output projections, MLPs, norms) computes the
padded tokens too, and attention is quadratic in the padded length, so a 64-token row padded to
256 pays (256 + N_ctx)^2 instead of (64 + N_ctx)^2; a masked SDPA also cannot take CPU's fused
mask-free kernel. On the tiny SD3 folder at 256 px (compute-bound on a CPU) that made a mixed
forward cost about as much as every row at the largest size (README, "Mixed sizes").

Length grouping removes the waste and keeps one forward: the rows' layout between blocks stays
the padded one (the strip, each row's real tokens first), but each repeated block runs once per
distinct token count, on ``hidden_states[rows, :n]`` and the same rows of every other per-row
input, with the forward context narrowed to those rows (`row_data.narrowed_rows`, so LoRA
indices, folding counts and every other per-row value line up), and its outputs are scattered
back. Inside a group nothing is padded, so the stock block runs its stock, mask-free code: each
row computes exactly what its solo forward computes. The embeddings, ``norm_out``/``proj_out``
and the scheduler step still run once over the whole padded batch. It is the varlen idea
(FlashAttention's ``cu_seqlens``, Dao 2023, arXiv:2307.08691: one launch over rows of different
lengths) at block granularity, with the kernels every device has: k sizes cost k block calls.

Edits append a second padded segment (Flux Kontext, Qwen-Image-Edit: ``[noisy L_max |
reference R_max]``, each row real on the first tokens of each): `length_groups` then groups rows
by the pair of real counts (``reference=R_max``), and a group's tokens are its noisy ones
followed by its reference ones, nothing padded in either. Qwen-Image also splits each group by
its rows' text lengths (`qwen_image.mixed_sizes.text_groups`), so its texts are not padded
inside a group either.

Not used where it does not pay: k sizes cost k block calls, so a forward groups only when its
padding outweighs the extra calls' per-call overhead (`worth_grouping`: at least
`MIN_PADDED_TOKENS_PER_CALL` padded token slots per extra call). On the built-in ``digits``
model (at most 16 tokens a row) a mixed forward pads a few dozen slots, and grouping it cost
0.77x the padded forward's throughput (docs/scheduling.md, "Length groups"); the compute-bound folders pad
thousands and gain 1.3-1.6x.

Not used where it cannot run: inside a ``torch.compile`` trace (a regionally compiled block keeps
the masked padded path, so it sees no new guard or shape) and while a CUDA graph is captured
(`grouping_enabled`); there the padded, masked forward runs as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from diffserve.pipelines.row_data import NO_ROW_DATA, current_rows
from diffserve.pipelines.token_spans import IMAGE_TOKENS, REFERENCE_TOKENS


@dataclass(frozen=True)
class LengthGroup:
    """The rows of one token count in a padded mixed-size forward.

    Attributes:
        members: the forward rows of this count (ascending), for `row_data.narrowed_rows`.
        rows: the same as a (g,) long tensor on the forward's device.
        tokens: n, the real token count of every member (its first n of ``L_max``).
        reference: m, the real count of every member's second segment (its first m of
            ``R_max``: an edit's reference tokens, `token_spans.REFERENCE_TOKENS`); 0 without one.
    """

    members: tuple[int, ...]
    rows: torch.Tensor
    tokens: int
    reference: int = 0


#: Padded token slots each extra block call must remove for a forward to run per length group
#: (`worth_grouping`). Measured on CPU (docs/scheduling.md, "Length groups"): grouping the built-in
#: ``digits`` model's mixed forwards (~40 padded slots, 3-4 sizes) cost 0.77x throughput, the
#: tiny SD3 folders' (~1100 padded slots) gained 1.3-1.6x; 256 lies between. Unmeasured on GPUs.
MIN_PADDED_TOKENS_PER_CALL = 256


def worth_grouping(real: Sequence[int], padded: int, calls: int) -> bool:
    """Whether running a forward's blocks once per group (`calls` of them) beats one padded call:
    the padding removed, ``sum(padded - n for n in real)`` token slots, is at least
    `MIN_PADDED_TOKENS_PER_CALL` per extra call.

    Args:
        real: each row's real token count (all its padded segments together).
        padded: the token slots of every row in the padded forward.
        calls: the block calls grouping makes (one per group).
    """
    return sum(padded - n for n in real) >= MIN_PADDED_TOKENS_PER_CALL * (calls - 1)


def grouping_enabled() -> bool:
    """Whether blocks may run per length group now: eager execution, no CUDA graph capture."""
    if torch.compiler.is_compiling():
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def length_groups(longest: int, device: torch.device, tokens_key: str = IMAGE_TOKENS,
                  reference: int = 0) -> tuple[LengthGroup, ...] | None:
    """The rows of the forward running now grouped by their real token count (and, with a
    second padded segment, by the pair of counts).

    Args:
        longest: L_max, the padded token count of the tensors the groups index.
        device: where the row index tensors go.
        tokens_key: the row-data key holding each row's real count (default
            `token_spans.IMAGE_TOKENS`).
        reference: R_max, the padded length of a second segment after the first ``longest``
            tokens (Kontext's reference tokens; each row's real count in row data
            `token_spans.REFERENCE_TOKENS`); 0 (default) without one.

    Returns:
        One `LengthGroup` per distinct count (per distinct (count, reference count) pair;
        ascending), or None when grouping does not apply: no row data, every row is ``longest``
        (and ``reference``) long, the padding is too small to pay for the extra calls
        (`worth_grouping`), or `grouping_enabled` is False.

    Raises:
        ValueError: a row's count exceeds `longest` or its reference count `reference` (the row
            data is not this forward's).
    """
    if not grouping_enabled():
        return None
    rows = current_rows()
    if rows is NO_ROW_DATA:
        return None

    def build() -> tuple[LengthGroup, ...] | None:  # once per forward layout (every block reads it)
        counts = rows.get(tokens_key)
        if not counts:
            return None
        refs = (rows.get(REFERENCE_TOKENS) or (0,) * len(counts)) if reference else (0,) * len(counts)
        if all(c == longest for c in counts) and all(m == reference for m in refs):
            return None
        for real, padded, what in ((counts, longest, "tokens"), (refs, reference, "reference tokens")):
            if max(real) > padded:
                raise ValueError(f"a row of {max(real)} {what} in a forward padded to {padded}")
        pairs = sorted(set(zip(counts, refs)))
        if not worth_grouping([n + m for n, m in zip(counts, refs)], longest + reference, len(pairs)):
            return None
        groups = []
        for n, m in pairs:
            members = tuple(r for r, pair in enumerate(zip(counts, refs)) if pair == (n, m))
            groups.append(LengthGroup(members, torch.tensor(members, dtype=torch.long, device=device), n, m))
        return tuple(groups)

    return rows.derived(("length_groups", longest, tokens_key, reference, str(device)), build)


def scatter_rows(out: torch.Tensor, group: LengthGroup, value: torch.Tensor) -> None:
    """Write a group's result back in place: ``out[group.rows, :value.shape[1]] = value``.

    Args:
        out: (B, L, ...) the padded output.
        group: the group `value` was computed for.
        value: (g, n, ...) with n <= L (a group's real tokens) or n == L (a per-row tensor).
    """
    if value.shape[1] == out.shape[1]:
        out.index_copy_(0, group.rows, value)
    else:
        out[:, : value.shape[1]].index_copy_(0, group.rows, value)


def gather_rows(x: torch.Tensor, group: LengthGroup, tokens: int | None = None) -> torch.Tensor:
    """``x[group.rows]`` (and its first `tokens` along dim 1 when given): a group's share of a
    per-row tensor (B, ...) or of a padded token tensor (B, L_max, ...)."""
    picked = x.index_select(0, group.rows)
    return picked if tokens is None else picked[:, :tokens]


def gather_segments(x: torch.Tensor, group: LengthGroup, longest: int) -> torch.Tensor:
    """A group's real image tokens of a padded ``[noisy (L_max) | reference (R_max)]`` sequence:
    x (B, L_max + R_max, D) -> (g, n + m, D), its rows' first n noisy then first m reference
    tokens (just the first n without a reference segment)."""
    picked = gather_rows(x, group, group.tokens)
    if not group.reference:
        return picked
    return torch.cat([picked, gather_rows(x[:, longest:], group, group.reference)], dim=1)


def scatter_segments(out: torch.Tensor, group: LengthGroup, value: torch.Tensor, longest: int) -> None:
    """Write `gather_segments`' layout back in place: value (g, n + m, D) into the rows' first n
    noisy and first m reference tokens of out (B, L_max + R_max, D)."""
    scatter_rows(out, group, value[:, : group.tokens])
    if group.reference:
        scatter_rows(out[:, longest:], group, value[:, group.tokens:])


__all__ = ["LengthGroup", "gather_rows", "gather_segments", "grouping_enabled", "length_groups", "scatter_rows",
           "scatter_segments"]

