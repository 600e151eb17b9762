"""Per-row data of a step batch: per-request values that one shared denoiser forward reads row
by row, without being denoiser arguments (and without splitting the batch key).

A request puts plain values into ``RequestState.row_data`` (e.g. its LoRA adapters, the text
length its folded context stands for, the clean latent frames of a stream chunk). Collation
lays each value out over the request's rows of every guidance branch, branch-major like every
other per-row input (row ``b * N + i`` belongs to latent row ``i``; `step_batch`): a `RowData`
maps each key to one value per forward row (None on the rows of requests that set none). It
is built once per batch composition and kept with the batch's cached inputs, so a repeated
batch pays nothing for it.

During the forward, the step adapter publishes the batch's `RowData` as the *forward context*
(`forward_rows`, a context variable): whatever runs inside the denoiser call (attention
processors, LoRA layers, a family's plug-ins) reads it with `current_rows()`. Code that runs
the forward over a subset of the rows narrows it first (`narrowed_rows`: TeaCache computing
only some requests' blocks; `RowData.select` for CFG parallelism's share of the rows), so
per-row data always lines up with the rows being computed. Outside any forward the context is
empty, so a module shared with a plain diffusers pipeline computes stock diffusers there.

Values are plain and hashable (ints, floats, tuples), so a `RowData` can also be part of a
cache key (CUDA graphs capture one graph per row-data layout).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from diffserve.pipelines.request_state import RequestState


_MISSING = object()


class RowData(Mapping):
    """Per-row values of one denoiser forward: ``data[key]`` is a tuple with one value per
    forward row, branch-major (see the module docstring).

    Args:
        values: key -> tuple of `num_rows` values.
        num_rows: rows of the forward.
    """

    __slots__ = ("_values", "num_rows", "_memo")

    def __init__(self, values: Mapping[str, tuple], num_rows: int):
        self._values = dict(values)
        self.num_rows = num_rows
        self._memo: dict[tuple, Any] = {}  # derived values, computed once per RowData

    def __getitem__(self, key: str) -> tuple:
        return self._values[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __hash__(self) -> int:
        return hash(self.key())

    def __repr__(self) -> str:
        return f"RowData({self._values!r}, num_rows={self.num_rows})"

    def uniform(self, key: str, default: Any = None) -> Any:
        """The value every row holds for `key` (`default` when no row has the key).

        Raises:
            ValueError: the rows hold different values (the caller needs one per batch; the
                batch key keeps such requests apart).
        """
        memo = ("uniform", key)
        if memo in self._memo:  # read by every block of a forward: checked once
            return self._memo[memo]
        rows = self._values.get(key)
        if not rows:
            return default
        first = rows[0]
        if any(v != first for v in rows):
            raise ValueError(f"rows of one forward hold different {key!r} values: {sorted(set(rows), key=repr)}")
        self._memo[memo] = first
        return first

    def tensor(self, key: str, dtype: torch.dtype, device: torch.device | str, default: Any = 0) -> torch.Tensor:
        """(num_rows,) tensor of a numeric key's values (`default` on rows that hold None);
        built once per `RowData` (so once per batch composition) and then reused."""
        memo = ("tensor", key, dtype, str(device), default)
        hit = self._memo.get(memo)
        if hit is None:
            values = [default if v is None else v for v in self._values[key]]
            hit = self._memo[memo] = torch.tensor(values, dtype=dtype).to(device, non_blocking=True)
        return hit

    def derived(self, key: Hashable, build: Callable[[], Any]) -> Any:
        """``build()`` computed once per `RowData` under `key` (e.g. a mask or index tensors a
        plug-in derives from the rows' values), then reused by every block of every forward of
        the same batch composition."""
        memo = ("derived", key)
        hit = self._memo.get(memo, _MISSING)
        if hit is _MISSING:  # (a None result is remembered too)
            hit = self._memo[memo] = build()
        return hit

    def select(self, index: Sequence[int] | torch.Tensor) -> "RowData":
        """The row data of a forward over rows `index` of this one (in that order)."""
        if isinstance(index, torch.Tensor):
            index = index.tolist()
        index = list(index)
        return RowData({k: tuple(v[i] for i in index) for k, v in self._values.items()}, len(index))

    def padded(self, rows: int) -> "RowData":
        """This row data extended to `rows` rows by repeating the last row (a forward padded to
        a fixed size, e.g. a CUDA graph's bucket)."""
        if rows <= self.num_rows or not self._values:
            return self
        memo = ("padded", rows)
        if memo not in self._memo:
            self._memo[memo] = self.select(list(range(self.num_rows)) + [self.num_rows - 1] * (rows - self.num_rows))
        return self._memo[memo]

    def key(self) -> Hashable:
        """A hashable description of every value (for caches keyed by the forward's layout)."""
        if ("key",) not in self._memo:
            self._memo[("key",)] = tuple(sorted(self._values.items()))
        return self._memo[("key",)]


#: The row data of a forward without any (every batch whose requests set none).
NO_ROW_DATA = RowData({}, 0)


def collate_row_data(states: Sequence["RequestState"], branches: int) -> RowData:
    """Lay the requests' ``row_data`` out over the forward's rows, branch-major: each request's
    value on its ``num_images`` rows of each of the `branches` branches (None where a request
    sets no value for a key another request sets). `NO_ROW_DATA` when no request has any."""
    if not any(s.row_data for s in states):
        return NO_ROW_DATA
    keys = list(dict.fromkeys(k for s in states for k in s.row_data))
    branches = max(branches, 1)
    values = {}
    for key in keys:
        per_image = [s.row_data.get(key) for s in states for _ in range(s.num_images)]
        values[key] = tuple(per_image * branches)
    return RowData(values, branches * sum(s.num_images for s in states))


_CURRENT: ContextVar[RowData] = ContextVar("diffserve_forward_rows", default=NO_ROW_DATA)


@contextmanager
def forward_rows(rows: RowData) -> Iterator[RowData]:
    """Within the block, `current_rows()` is `rows` (the step adapter sets it around each
    denoiser call; per thread)."""
    token = _CURRENT.set(rows)
    try:
        yield rows
    finally:
        _CURRENT.reset(token)


def current_rows() -> RowData:
    """The row data of the denoiser forward running in this thread (`NO_ROW_DATA` outside any)."""
    return _CURRENT.get()


@contextmanager
def narrowed_rows(index: Sequence[int] | torch.Tensor) -> Iterator[RowData]:
    """Within the block, the forward context holds only rows `index` of the current one (a
    forward over some of the batch's rows, e.g. TeaCache's computing requests). A tuple `index`
    (a length group's members, narrowed once per block) gets the same `RowData` every time, so
    what plug-ins derive from it (`RowData.derived`) is built once per batch composition."""
    rows = current_rows()
    if not rows:
        yield rows
        return
    narrowed = rows.derived(("narrowed", index), lambda: rows.select(index)) if isinstance(index, tuple) \
        else rows.select(index)
    with forward_rows(narrowed):
        yield narrowed


__all__ = ["NO_ROW_DATA", "RowData", "collate_row_data", "current_rows", "forward_rows", "narrowed_rows"]
