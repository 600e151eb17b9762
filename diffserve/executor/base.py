"""`Executor`: the interface between the engine and the workers that run the model."""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

from diffserve.core.messages import (
    MemoryProfile,
    ModelInfo,
    RequestPlan,
    RunnerOutput,
    SchedulerOutput,
    StepOutput,
    WorkError,
)
from diffserve.core.sampling_params import SamplingParams
from diffserve.runner.worker import CHUNK, DECODE, PREPARE, PREVIEW, WorkItem

logger = logging.getLogger(__name__)

#: Longest `execute` blocks for background work when its output steps nothing (seconds).
WAIT_S = 0.05


class Executor(ABC):
    """Runs scheduler outputs on the workers: ONE `execute` call per engine tick carries
    everything the tick asks (frees, prepares, decodes, previews, chunk boundaries and the
    denoising step) and returns the step's outcome with the background work that completed
    meanwhile. The step is synchronous (the engine's loop paces the steps); prepare and decode
    work completes in the background, beside the steps, so a long encode or video decode does
    not stall every running request's step.

    Subclasses implement the transport (`_submit` / `_step`); the bookkeeping of the work in
    flight is here.

    Threading: one engine thread calls `execute` at a time; `plan`, `info`, `stats` and
    `peak_memory_bytes` may be called from any thread.
    """

    def __init__(self) -> None:
        #: background work in flight, in submission order
        self._inflight: list[tuple[WorkItem, Future]] = []

    @property
    def busy(self) -> bool:
        """Background work is in flight (`execute` then waits for it when a tick steps nothing)."""
        return bool(self._inflight)

    # ------------------------------------------------------------------ one tick
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """Run one tick's scheduler output (see `SchedulerOutput` for the order). When it steps
        nothing while background work is in flight, waits up to `WAIT_S` seconds for some of it
        instead of returning at once (so an idle engine loop does not spin); with
        `SchedulerOutput.join_wait_s`, waits up to that many seconds for the tick's prepares.

        Raises:
            EngineDeadError: the step could not run (a worker died); background work that
                fails as a whole is reported in `RunnerOutput.failed` instead.
        """
        submitted = self._submit(out)
        if submitted:
            self._inflight.extend(submitted)
        result = RunnerOutput()
        if out.step_ids:
            result.step_start = time.perf_counter()
            result.step = self._step(out.step_ids)
            result.step_end = time.perf_counter()
        elif out.join_wait_s and submitted:
            wait([f for item, f in submitted if item.kind == PREPARE], timeout=out.join_wait_s)
        elif self._inflight:
            wait([f for _, f in self._inflight], timeout=WAIT_S, return_when=FIRST_COMPLETED)
        if self._inflight:
            self._collect(result)
        return result

    def _collect(self, result: RunnerOutput) -> None:
        """Move the completed background work into `result`, in submission order."""
        still = []
        prepared, decoded, chunks, failed = [], [], [], []
        for item, future in self._inflight:
            if not future.done():
                still.append((item, future))
                continue
            try:
                value = future.result()
            except Exception as exc:  # noqa: BLE001 - the item's requests fail, the engine goes on
                logger.error("background %s work for %s failed: %r", item.kind, item.request_ids, exc)
                failed.append((item.request_ids, WorkError.of(exc)))
                continue
            if item.kind == PREPARE:
                prepared += value
            elif item.kind in (DECODE, PREVIEW):
                decoded += value
            elif item.kind == CHUNK:
                chunks += value
        self._inflight = still
        if prepared:
            result.prepared = prepared
        if decoded:
            result.decoded = decoded
        if chunks:
            result.chunks = chunks
        if failed:
            result.failed = failed

    @abstractmethod
    def _submit(self, out: SchedulerOutput) -> list[tuple[WorkItem, Future]]:
        """Hand `out` to the workers (non-blocking): its frees and background work (the
        snapshots its decodes read taken before `_step` runs) and, where the transport sends
        everything at once, its step; returns each background work item's future."""

    @abstractmethod
    def _step(self, request_ids: list[str]) -> StepOutput:
        """Run the denoising step of `request_ids` and wait for its outcome."""

    # ------------------------------------------------------------------ LoRA adapters
    def submit_load_lora(self, name: str, path: str) -> "Future[dict[str, Any]]":
        """Read the LoRA adapter at `path` into every worker as `name`, beside the steps;
        resolves to its summary (format, rank, modules, bytes) or the worker's error
        (`InvalidRequestError` naming ``path``)."""
        raise NotImplementedError(f"{type(self).__name__} does not load LoRA adapters")

    def unload_lora(self, name: str) -> None:
        """Drop adapter `name` from every worker (no request may hold it)."""
        raise NotImplementedError(f"{type(self).__name__} does not load LoRA adapters")

    # ------------------------------------------------------------------ queries
    @abstractmethod
    def info(self) -> ModelInfo:
        """The loaded model's spec and pipeline class."""

    @abstractmethod
    def plan(self, params: SamplingParams, inputs: Any = None) -> RequestPlan:
        """Rows and batch key of a request (raises InvalidRequestError for fields the family
        cannot honour). Thread-safe."""

    @abstractmethod
    def stats(self) -> dict[str, Any]:
        """Acceleration counters and worker health (see `InProcessExecutor.stats`)."""

    @abstractmethod
    def peak_memory_bytes(self) -> int:
        """Device allocator peak (GPU) or process peak RSS (CPU), bytes."""

    @property
    def runner(self):
        """The `Runner` in this process (in-process executor only; None otherwise). For tests
        and benchmarks: the engine itself never calls it."""
        return None

    # ------------------------------------------------------------------ memory
    def memory_profile(self) -> MemoryProfile | None:
        """The model's memory profile for memory-aware admission, measured on first call while
        nothing runs (`diffserve.memory.profile`); None if the workers cannot budget
        memory."""
        return None

    def sleep(self, level: int) -> None:
        """Sleep mode, with no request in flight: level 1 moves the weights off the device,
        level 2 discards them (`diffserve.memory.sleep`).

        Raises:
            InvalidRequestError: `level` is not 1 or 2.
        """
        raise NotImplementedError(f"{type(self).__name__} has no sleep mode")

    def wake_up(self) -> None:
        """Restore the weights put to sleep (no-op while awake)."""
        raise NotImplementedError(f"{type(self).__name__} has no sleep mode")

    @property
    def dead(self) -> str | None:
        """Why the executor can no longer run work (a worker died), or None while healthy."""
        return None

    def shutdown(self) -> None:
        """Stop background work (idempotent)."""
