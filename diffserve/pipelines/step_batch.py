"""`StepBatch`: several requests' rows gathered into ONE denoiser forward, and how the output
maps back.

Layout (branch-major): with ``B`` guidance branches (2 with CFG) and ``N`` latent rows in total
(the sum of the requests' images), forward row ``b * N + i`` is branch ``b`` of latent row ``i``,
and the requests' latent rows are consecutive in batch order. So ``out.chunk(B)`` gives per-branch
(N, ...) tensors aligned with the concatenated latents, and CFG, the diffusion-scheduler step and
the split back are each one tensor expression for the whole batch.

Between steps the same requests usually step together until one joins or leaves. `BatchCache`
keeps what does not change for such a run (the concatenated prompt embeddings and other
per-branch inputs, per-row guidance weights, per-row timestep / sigma tables) and the previous
step's concatenated latents, so a repeated batch costs a constant number of tensor operations
whatever its number of requests, with no host-device synchronisation.

Besides the denoiser's inputs, a batch carries its requests' per-row data (`row_data.RowData`,
laid out in the same branch-major row order), which the forward reads through the forward
context instead of as arguments (LoRA adapters per row, Wan's folded context length).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from diffserve.pipelines.row_data import NO_ROW_DATA, RowData, collate_row_data

if TYPE_CHECKING:
    from diffserve.pipelines.request_state import RequestState


@dataclass
class StepBatch:
    """Inputs of one denoiser forward and how to split its output back.

    Attributes:
        states: the requests in the batch, in row order.
        branches: guidance branches B (1 or 2), equal for every request (batch key).
        row_counts: latent rows (images) of each request, summing to N.
        inputs: the denoiser inputs, each per-row tensor (B * N, ...), branch-major; shared
            inputs (not per row) as the first request has them.
        latents: (N, ...) the requests' latents concatenated (what the diffusion scheduler
            steps).
        timesteps: (N,) each latent row's current timestep.
        row_data: the requests' per-row data (`RowData`, branch-major, B * N rows);
            `row_data.NO_ROW_DATA` when no request has any.
        latent_sizes: None when every request's latents have one shape; else each request's
            latent shape after the row dim ((C, h, w) for spatial latents, (L, C) for packed
            token sequences such as Flux's): the batch's latents are then zero-padded at the
            end of each dim to the largest (mixed sizes, `token_spans`) and `split` crops each
            request's region back out.
    """

    states: list["RequestState"]
    branches: int
    row_counts: list[int]
    inputs: dict[str, Any]
    latents: torch.Tensor
    timesteps: torch.Tensor
    cache: "BatchCache | None" = field(default=None, repr=False)
    row_data: RowData = NO_ROW_DATA
    latent_sizes: list[tuple[int, ...]] | None = None
    _offsets: list[int] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        offsets, at = [], 0
        for n in self.row_counts:
            offsets.append(at)
            at += n
        self._offsets = offsets

    @property
    def num_latent_rows(self) -> int:
        """N: images in the batch (rows of one branch)."""
        return sum(self.row_counts)

    @property
    def num_rows(self) -> int:
        """Rows of the forward: branches x images."""
        return self.branches * self.num_latent_rows

    def row_values(self, per_request: Sequence[float], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(N,) tensor on the latents' device holding each request's value on its rows (cached
        for a repeated batch)."""
        if self.cache is not None:
            key = (tuple(per_request), dtype)
            hit = self.cache.row_values.get(key)
            if hit is None:
                hit = self.cache.row_values[key] = self._row_values(per_request, dtype)
            return hit
        return self._row_values(per_request, dtype)

    def _row_values(self, per_request: Sequence[float], dtype: torch.dtype) -> torch.Tensor:
        values = torch.tensor(per_request, dtype=dtype)
        if len(per_request) > 1 or self.row_counts[0] > 1:
            values = values.repeat_interleave(torch.tensor(self.row_counts))
        return values.to(self.latents.device, non_blocking=True)

    def split(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Split an (N, ...) tensor into each request's rows (views; with `latent_sizes`, each
        cropped to its request's own spatial size)."""
        if len(self.row_counts) == 1:
            return [tensor]
        parts = torch.split(tensor, self.row_counts, dim=0)
        if self.latent_sizes is None:
            return list(parts)
        return [part[(slice(None), *(slice(0, d) for d in size))] for part, size in zip(parts, self.latent_sizes)]

    def request_rows(self, i: int) -> torch.Tensor:
        """(branches * n_i,) long indices of request `i`'s rows in the forward, branch order."""
        n, start, total = self.row_counts[i], self._offsets[i], self.num_latent_rows
        return torch.cat([torch.arange(b * total + start, b * total + start + n)
                          for b in range(self.branches)])


class BatchCache:
    """What a batch of the same requests reuses from one step to the next (see the module
    docstring). Holds references to the states of the last batch, so identity checks are safe.

    Attributes:
        states: the last batch's states, in order.
        steps: each state's ``step_index`` when the cache was last valid.
        inputs: the concatenated per-branch and shared inputs (everything but hidden_states
            and timestep).
        latents / views: the last step's concatenated latents (N, ...) and the per-request
            views of it the states hold; reused as the next forward's input when every state
            still holds its view.
        ahead: steps taken since the composition was cached (row ``ahead`` of the tables).
        t_table: (S, N) float32 timestep of each latent row ``k`` steps after the cache was
            built (S: the most steps any request has left; rows past a request's end repeat
            its last timestep and are never read); dt_table: (S, N) float32 ``sigma_{i+1} -
            sigma_i`` likewise (flow-matching), or None.
        row_values: per-request value lists -> (N,) tensors (guidance weights).
        row_data: the composition's per-row data (`RowData`).
    """

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        """Forget everything (the next collate rebuilds)."""
        self.states: list["RequestState"] = []
        self.steps: list[int] = []
        self.inputs: dict[str, Any] = {}
        self.latents: torch.Tensor | None = None
        self.views: list[torch.Tensor] = []
        self.ahead = 0
        self.branches = 1
        self.t_table: torch.Tensor | None = None
        self.dt_table: torch.Tensor | None = None
        self._t_by_dtype: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}
        self.row_values: dict[Any, torch.Tensor] = {}
        self.row_data: RowData = NO_ROW_DATA
        self.latent_sizes: list[tuple[int, ...]] | None = None

    def matches(self, states: list["RequestState"]) -> bool:
        """The same request states, in the same order, each exactly one step further."""
        if len(states) != len(self.states) or not all(a is b for a, b in zip(states, self.states)):
            return False
        return all(s.step_index == k + 1 for s, k in zip(states, self.steps))

    def reset(self, states: list["RequestState"], inputs: dict[str, Any]) -> None:
        """Start caching a new batch composition: its inputs, and the timestep (and sigma
        step) tables of all its remaining steps, so each step then reads one row of them."""
        self.states = list(states)
        self.steps = [s.step_index for s in states]
        self.inputs = inputs
        self.latents, self.views = None, []
        self.row_values = {}
        self.ahead = 0
        self.branches = max(len(states[0].branches), 1)
        self.row_data = collate_row_data(states, self.branches)
        self._t_by_dtype = {}
        device = states[0].latents.device
        timesteps = [s.timesteps for s in states]
        horizon = max(max(t.shape[0] - i for t, i in zip(timesteps, self.steps)), 1)
        counts = [s.num_images for s in states]
        repeats = None if all(n == 1 for n in counts) else torch.tensor(counts, device=device)
        sigmas = [s.sigmas for s in states]
        if any(x is None or x.shape[0] != t.shape[0] + 1 for x, t in zip(sigmas, timesteps)):
            sigmas = None  # not every request steps by flow-matching Euler: no sigma-step table
        self.t_table, self.dt_table = _step_tables(timesteps, sigmas, self.steps, horizon, device, repeats)

    def advance(self) -> None:
        """Record that every state of the batch took one step (after the step)."""
        self.steps = [s.step_index - 1 for s in self.states]
        self.ahead += 1

    def timesteps(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Each latent row's current timestep (N,) and the same for every forward row,
        branch-major (B * N,), in `dtype`: views of precomputed tables (no tensor operation)."""
        tables = self._t_by_dtype.get(dtype)
        if tables is None:
            t = self.t_table.to(dtype)
            tables = self._t_by_dtype[dtype] = (t, t.repeat(1, self.branches))
        return tables[0][self.ahead], tables[1][self.ahead]

    def sigma_deltas(self) -> torch.Tensor:
        """(N,) float32 ``sigma_{i+1} - sigma_i`` of each row's current step (a view)."""
        return self.dt_table[self.ahead]


def _step_tables(timesteps: list[torch.Tensor], sigmas: list[torch.Tensor] | None, steps: list[int], horizon: int,
                 device: torch.device, repeats: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(S, N) float32 timestep and sigma-step tables of several requests, built with one index
    computation and one gather each (no per-request tensor operation).

    Row ``k``, column ``i`` of the timestep table is ``timesteps[i][j]`` with ``j = min(steps[i]
    + k, T_i - 1)`` (``T_i`` its number of steps: past the end the last value repeats); of the
    sigma-step table ``sigmas[i][j + 1] - sigmas[i][j]`` for the same ``j`` (``sigmas[i]`` holds
    ``T_i + 1`` noise levels). `repeats` (n,) repeats each request's column for its latent rows
    (None: one row each).

    Args:
        timesteps: n (T_i,) tensors, any float dtype, on one device.
        sigmas: n (T_i + 1,) tensors, or None (no flow-matching Euler step: no sigma table).
        steps: each request's current step index.
        horizon: S, the rows to build.
    """
    lengths = [t.shape[0] for t in timesteps]
    ahead = torch.arange(horizon)[:, None]
    meta = torch.tensor([steps, lengths])  # (2, n) int64
    position = torch.minimum(meta[0] + ahead, meta[1] - 1)  # (S, n) index into each request's own schedule
    index = (position + (meta[1].cumsum(0) - meta[1])).to(device, non_blocking=True)
    t_table = torch.cat(timesteps).to(device, torch.float32)[index]
    dt_table = None
    if sigmas is not None:
        flat = torch.cat(sigmas).to(device, torch.float32)
        index = index + torch.arange(len(steps), device=device)  # each sigma schedule is one longer
        dt_table = flat[index + 1] - flat[index]
    if repeats is not None:
        t_table = t_table.repeat_interleave(repeats, dim=1)
        dt_table = None if dt_table is None else dt_table.repeat_interleave(repeats, dim=1)
    return t_table.contiguous(), None if dt_table is None else dt_table.contiguous()


def _pad_to(tensors: list[torch.Tensor], value: float) -> list[torch.Tensor]:
    """Right-pad (rows, L_i, ...) tensors along dim 1 to the longest L."""
    longest = max(t.shape[1] for t in tensors)
    out = []
    for t in tensors:
        extra = longest - t.shape[1]
        if extra:
            pad = [0, 0] * (t.dim() - 2) + [0, extra]
            t = F.pad(t, pad, value=value)
        out.append(t)
    return out


def _concat(values: list[Any], pad_value: float | None) -> Any:
    """Concatenate per-branch-per-request values: tensors along dim 0 (padded along dim 1 when
    `pad_value` is set), dicts key by key, lists end to end; None stays None."""
    first = values[0]
    if first is None:
        return None
    if isinstance(first, torch.Tensor):
        if len(values) == 1:
            return first
        if pad_value is not None:
            values = _pad_to(values, pad_value)
        return torch.cat(values, dim=0)
    if isinstance(first, dict):
        return {k: _concat([v[k] for v in values], pad_value) for k in first}
    if isinstance(first, list):
        return [item for v in values for item in v]
    raise TypeError(f"cannot batch a per-row input of type {type(first).__name__}")


def padding_mask(values: list[torch.Tensor]) -> torch.Tensor | None:
    """(rows, L) bool mask of the real positions of (rows_i, L_i, ...) tensors right-padded
    along dim 1 to the longest L, or None when none is padded (every L_i equal): the denoiser
    then attends without a mask, as diffusers does for unpadded text."""
    lengths = [v.shape[1] for v in values]
    longest = max(lengths)
    if all(n == longest for n in lengths):
        return None
    per_row = torch.tensor([n for v, n in zip(values, lengths) for _ in range(v.shape[0])])
    return torch.arange(longest)[None, :] < per_row[:, None]


def latent_sizes(states: Sequence["RequestState"]) -> list[tuple[int, ...]] | None:
    """Each request's latent shape after the row dim ((C, h, w) spatial, (L, C) packed), or
    None when they are all equal (the usual batch: no padding)."""
    sizes = [tuple(s.latents.shape[1:]) for s in states]
    return None if all(size == sizes[0] for size in sizes) else sizes


def pad_latents(tensors: list[torch.Tensor], sizes: list[tuple[int, ...]] | None) -> torch.Tensor:
    """Concatenate (n_i, *size_i) tensors along dim 0, zero-padding each dim after the row dim
    at its end to the largest size (`sizes` None: all equal, a plain concatenation)."""
    if len(tensors) == 1:
        return tensors[0]
    if sizes is None:
        return torch.cat(tensors)
    grid = [max(d) for d in zip(*sizes)]
    padded = []
    for t, size in zip(tensors, sizes):
        pad = [x for g, d in zip(reversed(grid), reversed(size)) for x in (0, g - d)]
        padded.append(F.pad(t, pad) if any(pad) else t)
    return torch.cat(padded)


def collate_branches(states: list["RequestState"], model_input: Callable[["RequestState"], torch.Tensor] | None,
                     padded_inputs: dict[str, tuple[str | None, float]], cache: BatchCache | None = None) -> StepBatch:
    """The default collation (see `PipelineAdapter.collate`).

    Args:
        states: requests sharing a batch key (same branch count; latents of different shapes
            are zero-padded to the largest, `StepBatch.latent_sizes`).
        model_input: a request's latent rows as the denoiser sees them; None = its latents.
        padded_inputs: per-branch keys of variable length (dim 1) -> (mask key or None, pad value);
            a mask key receives the (B*N, L) bool `padding_mask` (None when nothing is padded).
        cache: the adapter's `BatchCache`; a batch of the same requests as the previous step
            reuses its inputs, latents and timestep tables.

    Returns:
        A `StepBatch` whose inputs hold ``hidden_states`` (B*N, ...), ``timestep`` (B*N,), every
        per-branch key concatenated branch-major (plus its padding mask), and the first
        request's shared inputs; and the requests' per-row data (`row_data.collate_row_data`).
    """
    branches = len(states[0].branches)
    row_counts = [s.num_images for s in states]
    hit = cache is not None and cache.matches(states)
    if hit:
        inputs = dict(cache.inputs)
        sizes = cache.latent_sizes
    else:
        sizes = latent_sizes(states)
        inputs = {}
        if branches:
            for key in states[0].branches[0]:
                values = [s.branches[b][key] for b in range(branches) for s in states]
                mask_key, pad_value = padded_inputs.get(key, (None, None))
                inputs[key] = _concat(values, pad_value)
                if mask_key is not None:
                    mask = padding_mask(values)
                    inputs[mask_key] = None if mask is None else mask.to(inputs[key].device)
        inputs.update(states[0].shared)
        if cache is not None:
            cache.reset(states, dict(inputs))
            cache.latent_sizes = sizes
    if hit and cache.latents is not None and all(v is s.latents for v, s in zip(cache.views, states)):
        latents = cache.latents  # the previous step's output, already concatenated
    else:
        latents = pad_latents([s.latents for s in states], sizes)
    if model_input is None:
        x = latents
    else:
        x = pad_latents([model_input(s) for s in states], sizes)
    if cache is not None:
        t, inputs["timestep"] = cache.timesteps(states[0].timesteps.dtype)
    else:
        if len(states) == 1:
            t = states[0].timestep.expand(states[0].num_images)
        else:
            t = torch.cat([s.timestep.expand(s.num_images) for s in states])
        inputs["timestep"] = t if branches <= 1 else t.repeat(branches)
    inputs["hidden_states"] = x if branches <= 1 else torch.cat([x] * branches)
    row_data = cache.row_data if cache is not None else collate_row_data(states, branches)
    return StepBatch(states=states, branches=max(branches, 1), row_counts=row_counts, inputs=inputs,
                     latents=latents, timesteps=t, cache=cache, row_data=row_data, latent_sizes=sizes)
