"""CFG parallelism: the rows of one denoiser forward split across the ranks of a CFG group.

With classifier-free guidance a step batch holds two branches (unconditional, conditional) of
N rows each, laid out branch-major (`diffserve.pipelines.step_batch`). With
``cfg_parallel_size == 2`` rank ``r`` of the CFG group runs branch ``r`` only and the halves are
all-gathered, so every rank then holds the full (2N, ...) prediction and takes the identical
guidance combine and diffusion-scheduler step (their states stay equal without further
communication). A batch without CFG is split into contiguous row chunks the same way (data
parallel inside the step). As used by xDiT / vLLM-Omni ("CFG parallel").
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
import torch.distributed as dist

from diffserve.pipelines.step_batch import StepBatch


def row_chunks(num_rows: int, parts: int) -> list[tuple[int, int]]:
    """Contiguous, as-equal-as-possible [lo, hi) row ranges, one per part."""
    base, extra = divmod(num_rows, parts)
    bounds, lo = [], 0
    for p in range(parts):
        hi = lo + base + (1 if p < extra else 0)
        bounds.append((lo, hi))
        lo = hi
    return bounds


def _slice_rows(value: Any, num_rows: int, lo: int, hi: int) -> Any:
    if isinstance(value, torch.Tensor):
        return value[lo:hi] if value.dim() > 0 and value.shape[0] == num_rows else value
    if isinstance(value, dict):
        return {k: _slice_rows(v, num_rows, lo, hi) for k, v in value.items()}
    if isinstance(value, list) and len(value) == num_rows:
        return value[lo:hi]
    return value


def slice_batch(batch: StepBatch, lo: int, hi: int) -> StepBatch:
    """`batch` with only forward rows [lo, hi): its per-row inputs and per-row data (shared
    inputs untouched)."""
    shared = set(batch.states[0].shared) if batch.states else set()
    n = batch.num_rows
    inputs = {k: (v if k in shared else _slice_rows(v, n, lo, hi)) for k, v in batch.inputs.items()}
    row_data = batch.row_data.select(range(lo, hi)) if batch.row_data else batch.row_data
    return dataclasses.replace(batch, inputs=inputs, cache=None, row_data=row_data)


def gather_rows(local: torch.Tensor, bounds: list[tuple[int, int]], group) -> torch.Tensor:
    """All-gather each rank's rows (sizes from `bounds`) into the full (rows, ...) tensor."""
    longest = max(hi - lo for lo, hi in bounds)
    padded = local
    if local.shape[0] < longest:
        padded = torch.cat([local, local.new_zeros((longest - local.shape[0], *local.shape[1:]))])
    parts = [torch.empty_like(padded) for _ in bounds]
    dist.all_gather(parts, padded.contiguous(), group=group)
    return torch.cat([part[: hi - lo] for part, (lo, hi) in zip(parts, bounds)])


def cfg_parallel_denoise(denoise: Callable[[StepBatch], torch.Tensor], batch: StepBatch, cfg_rank: int,
                         cfg_size: int, group) -> torch.Tensor:
    """Run this rank's share of `batch`'s rows through `denoise` and all-gather the full output.

    Args:
        denoise: ``denoise(batch) -> (rows, ...)`` (the accelerator's denoise).
        cfg_rank / cfg_size / group: this rank's place in its CFG group.

    Returns:
        (rows, ...) predictions for the whole batch, identical on every rank of the group.
    """
    rows = batch.num_rows
    if rows < cfg_size:  # nothing to split: every rank computes everything
        return denoise(batch)
    bounds = row_chunks(rows, cfg_size)
    lo, hi = bounds[cfg_rank]
    local = denoise(slice_batch(batch, lo, hi))
    return gather_rows(local, bounds, group)
