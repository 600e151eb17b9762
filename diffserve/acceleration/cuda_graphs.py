"""CUDA graphs for the denoiser call: capture once per (row bucket, input shapes), replay after.

A small DiT on a fast GPU is launch-bound: its forward is hundreds of tiny kernels whose launch
cost does not grow with the batch (the built-in model: 32 rows cost what 2 cost). A CUDA graph
(NVIDIA, "CUDA Graphs"; PyTorch ``torch.cuda.graphs``) records the forward's kernels once and
replays them with one launch. Graphs need static shapes, so a step batch of ``r`` rows runs in
the graph of the smallest bucket ``>= r`` (powers of two up to ``max_batch_size``): its inputs
are copied into the bucket's static buffers (the extra rows keep stale values; rows never mix in
a DiT / UNet forward, so they cannot change real rows) and the first ``r`` output rows are
returned. Graphs are captured on first use of a shape (a few forwards of one-time cost) and
share one memory pool; the least recently used beyond `max_graphs` are dropped.

The step batch's per-row data (`diffserve.pipelines.row_data`: values the forward reads from
its context, not as arguments) is part of a graph's key: a graph is captured with the row data
of its bucket (the batch's, its last row repeated) as the forward context, so what the forward
read of it is baked into the graph, and a batch with other row data gets its own graph.

Composes with regional ``torch.compile`` (captured after compilation, so the compiled kernels
are what replays). Not with TeaCache / cache-dit, whose per-request decisions run Python
between blocks: those backends replace the denoiser call themselves.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from diffserve.pipelines.row_data import current_rows, forward_rows

logger = logging.getLogger(__name__)


def _flatten(value: Any, prefix: str, tensors: dict[str, torch.Tensor], static: list) -> None:
    """Split kwargs into tensors (by path) and a hashable description of everything else."""
    if isinstance(value, torch.Tensor):
        tensors[prefix] = value
        static.append((prefix, tuple(value.shape[1:]), value.dtype, value.device))
    elif isinstance(value, dict):
        for k in sorted(value):
            _flatten(value[k], f"{prefix}.{k}", tensors, static)
    elif isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
        for i, v in enumerate(value):
            _flatten(v, f"{prefix}[{i}]", tensors, static)
    else:
        static.append((prefix, repr(value)))


def _rebuild(value: Any, prefix: str, tensors: dict[str, torch.Tensor]) -> Any:
    """`value` with its tensors replaced by ``tensors[path]``."""
    if isinstance(value, torch.Tensor):
        return tensors[prefix]
    if isinstance(value, dict):
        return {k: _rebuild(v, f"{prefix}.{k}", tensors) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
        return type(value)(_rebuild(v, f"{prefix}[{i}]", tensors) for i, v in enumerate(value))
    return value


def _top_key(path: str) -> str:
    """``".encoder_hidden_states"`` / ``".added_cond_kwargs.time_ids"`` -> the top-level key."""
    return path[1:].split(".")[0].split("[")[0]


class _Graph:
    """One captured forward: static input buffers, the graph and its static output."""

    def __init__(self, call: Callable[[dict[str, Any]], torch.Tensor], kwargs: dict[str, Any], rows: int,
                 bucket: int, pool, shared_keys: frozenset[str]) -> None:
        flat: dict[str, torch.Tensor] = {}
        _flatten(kwargs, "", flat, [])
        self.rows_paths = [p for p, t in flat.items()
                           if _top_key(p) not in shared_keys and t.dim() > 0 and t.shape[0] == rows]
        self.buffers = {}
        for path, t in flat.items():
            if path in self.rows_paths:
                buf = t.new_empty((bucket, *t.shape[1:]))
                buf[:rows].copy_(t)
                if bucket > rows:
                    buf[rows:].copy_(t[-1:].expand(bucket - rows, *t.shape[1:]))
            else:
                buf = t.clone()
            self.buffers[path] = buf
        self.static_kwargs = _rebuild(kwargs, "", self.buffers)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up outside the capture (allocator, lazy inits)
            for _ in range(2):
                call(self.static_kwargs)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool, capture_error_mode="thread_local"):
            self.output = call(self.static_kwargs)

    def run(self, flat: dict[str, torch.Tensor], rows: int) -> torch.Tensor:
        for path in self.rows_paths:
            self.buffers[path][:rows].copy_(flat[path], non_blocking=True)
        for path, t in flat.items():
            if path not in self.rows_paths:
                self.buffers[path].copy_(t, non_blocking=True)
        self.graph.replay()
        return self.output[:rows].clone()


class CudaGraphDenoiser:
    """Replays captured CUDA graphs of ``adapter.call_denoiser`` (see the module docstring).

    Args:
        call: the plain denoiser call ``call(batch, kwargs) -> output``.
        max_rows: largest bucket (the engine's ``max_batch_size``).
        max_graphs: most graphs kept.

    Attributes:
        captures / replays / eager: counters (eager = batches above the largest bucket).
    """

    def __init__(self, call: Callable, max_rows: int, max_graphs: int = 32):
        self.call = call
        self.buckets = []
        b = 1
        while b < max_rows:
            self.buckets.append(b)
            b *= 2
        self.buckets.append(max_rows)
        self.max_graphs = max_graphs
        self.graphs: OrderedDict[Any, _Graph] = OrderedDict()
        self.pool = None
        self.captures = self.replays = self.eager = 0

    def __call__(self, batch, kwargs: dict[str, Any]) -> torch.Tensor:
        rows = kwargs["hidden_states"].shape[0]
        bucket = next((b for b in self.buckets if b >= rows), None)
        if bucket is None:
            self.eager += 1
            return self.call(batch, kwargs)
        flat: dict[str, torch.Tensor] = {}
        static: list = []
        _flatten(kwargs, "", flat, static)
        row_data = current_rows().padded(bucket)
        key = (bucket, tuple(static), row_data.key())
        graph = self.graphs.pop(key, None)
        if graph is None:
            shared = frozenset(batch.states[0].shared) if batch.states else frozenset()
            with forward_rows(row_data):
                graph = _Graph(lambda kw: self.call(batch, kw), kwargs, rows, bucket, self.pool, shared)
            # what the capture derived from the row data (memoised key masks, per-row RoPE
            # tables) lives in its memo: the graph replays those tensors' memory, so keep it
            graph.row_data = row_data
            if self.pool is None:
                self.pool = graph.graph.pool()
            self.captures += 1
            while len(self.graphs) >= self.max_graphs:
                self.graphs.popitem(last=False)
        self.graphs[key] = graph
        self.replays += 1
        return graph.run(flat, rows)

    def stats(self) -> dict[str, Any]:
        """``enabled``, ``graphs`` kept, ``captures``, ``replays``, ``eager`` calls, ``buckets``."""
        return {"enabled": True, "graphs": len(self.graphs), "captures": self.captures, "replays": self.replays,
                "eager": self.eager, "buckets": self.buckets}
