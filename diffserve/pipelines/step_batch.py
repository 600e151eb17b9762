"""`StepBatch`: several requests' rows gathered into ONE denoiser forward, and how the output
maps back.

Layout (branch-major): with ``B`` guidance branches (2 with CFG) and ``N`` latent rows in total
(the sum of the requests' images), forward row ``b * N + i`` is branch ``b`` of latent row ``i``,
and the requests' latent rows are consecutive in batch order. So ``out.chunk(B)`` gives per-branch
(N, ...) tensors aligned with the concatenated latents, and CFG, the diffusion-scheduler step and
the split back are each one tensor expression for the whole batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from diffserve.pipelines.base import RequestState


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
    """

    states: list["RequestState"]
    branches: int
    row_counts: list[int]
    inputs: dict[str, Any]
    latents: torch.Tensor
    timesteps: torch.Tensor
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
        """(N,) tensor on the latents' device holding each request's value on its rows."""
        values = torch.tensor(per_request, dtype=dtype)
        if len(per_request) > 1 or self.row_counts[0] > 1:
            values = values.repeat_interleave(torch.tensor(self.row_counts))
        return values.to(self.latents.device, non_blocking=True)

    def split(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Split an (N, ...) tensor into each request's rows (views)."""
        if len(self.row_counts) == 1:
            return [tensor]
        return list(torch.split(tensor, self.row_counts, dim=0))

    def request_rows(self, i: int) -> torch.Tensor:
        """(branches * n_i,) long indices of request `i`'s rows in the forward, branch order."""
        n, start, total = self.row_counts[i], self._offsets[i], self.num_latent_rows
        return torch.cat([torch.arange(b * total + start, b * total + start + n)
                          for b in range(self.branches)])


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


def collate_branches(states: list["RequestState"], model_input: Callable[["RequestState"], torch.Tensor],
                     pad_keys: dict[str, tuple[str | None, float]]) -> StepBatch:
    """The default collation (see `PipelineAdapter.collate`).

    Args:
        states: requests sharing a batch key (same branch count and latent shape).
        model_input: a request's latent rows as the denoiser sees them.
        pad_keys: per-branch keys of variable length (dim 1) -> (mask key or None, pad value);
            a mask key receives the (B*N, L) bool `padding_mask` (None when nothing is padded).

    Returns:
        A `StepBatch` whose inputs hold ``hidden_states`` (B*N, ...), ``timestep`` (B*N,), every
        per-branch key concatenated branch-major (plus its padding mask), and the first
        request's shared inputs.
    """
    branches = len(states[0].branches)
    row_counts = [s.num_images for s in states]
    if len(states) == 1:
        s = states[0]
        x = model_input(s)
        latents = s.latents
        t = s.timestep.expand(s.num_images)
    else:
        x = torch.cat([model_input(s) for s in states])
        latents = torch.cat([s.latents for s in states])
        t = torch.cat([s.timestep.expand(s.num_images) for s in states])
    inputs: dict[str, Any] = {}
    if branches:
        for key in states[0].branches[0]:
            values = [s.branches[b][key] for b in range(branches) for s in states]
            mask_key, pad_value = pad_keys.get(key, (None, None))
            inputs[key] = _concat(values, pad_value)
            if mask_key is not None:
                mask = padding_mask(values)
                inputs[mask_key] = None if mask is None else mask.to(inputs[key].device)
    inputs["hidden_states"] = x if branches <= 1 else torch.cat([x] * branches)
    inputs["timestep"] = t if branches <= 1 else t.repeat(branches)
    inputs.update(states[0].shared)
    return StepBatch(states=states, branches=max(branches, 1), row_counts=row_counts, inputs=inputs,
                     latents=latents, timesteps=t)
