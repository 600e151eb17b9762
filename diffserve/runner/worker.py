"""`Worker`: one `Runner` driven by the request scheduler's `SchedulerOutput`, one per tick.

The denoising step runs on the calling thread (the engine's, or a worker process's main
thread), so the engine paces the steps. Prepare, decode, preview and chunk-boundary work runs
on one side thread beside the steps: torch releases the GIL inside its ops, so a long prompt
encode or video decode uses another core (on CPU) or overlaps the step loop's host work (on
GPU: the side thread's kernels share the default stream, so the GPU work itself is serialized,
which keeps ordering trivially correct). With ``overlap=False`` everything runs inline on the
calling thread, in the order of `work_items` (deterministic interleaving, for tests and
baselines).

The in-process executor holds one `Worker`; the multi-process executor runs one in each worker
process (``is_driver`` only on rank 0: the other ranks free instead of decoding, and keep a
stream's state in step without its media).
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import torch

from diffserve.core.messages import SchedulerOutput, StepOutput
from diffserve.runner.base import Runner

#: Work item kinds (`WorkItem.kind`) and what their futures resolve to.
PREPARE = "prepare"  # list[Prepared]
DECODE = "decode"  # list[Decoded] (final: frees the requests)
PREVIEW = "preview"  # list[Decoded] with preview=True
CHUNK = "chunk"  # list[ChunkDone]


@dataclass(frozen=True, slots=True)
class WorkItem:
    """One piece of background work of a scheduler output.

    Attributes:
        kind: `PREPARE`, `DECODE`, `PREVIEW` or `CHUNK`.
        request_ids: the requests it is about (failed together if the item raises as a whole).
        payload: what the runner's method takes (the `NewRequest` list, or the `ChunkWork`).
    """

    kind: str
    request_ids: list[str]
    payload: Any = None


def work_items(out: SchedulerOutput) -> list[WorkItem]:
    """The background work of `out`, in the order it is queued on the side thread: previews,
    decodes, each chunk boundary on its own (a stream steps again as soon as its own boundary
    is done), then the prepares. The multi-process executor's driver and its workers both
    number the replies in this order."""
    items: list[WorkItem] = []
    if out.previews:
        items.append(WorkItem(PREVIEW, list(out.previews)))
    if out.decodes:
        items.append(WorkItem(DECODE, list(out.decodes)))
    for work in out.chunks:
        items.append(WorkItem(CHUNK, [work.request_id], work))
    if out.new_requests:
        items.append(WorkItem(PREPARE, [n.request_id for n in out.new_requests], list(out.new_requests)))
    return items


class Worker:
    """Executes scheduler outputs on `runner` (see the module docstring).

    Args:
        runner: the loaded model's runner.
        overlap: run background work on a side thread (False: inline, in order).
        is_driver: rank 0 of a multi-process grid (or the only worker): decodes and returns
            media. Other ranks free finished requests instead of decoding them and return
            chunk results without frames.
    """

    def __init__(self, runner: Runner, overlap: bool = True, is_driver: bool = True):
        self.runner = runner
        self.is_driver = is_driver
        self._side: ThreadPoolExecutor | None = None
        #: LoRA files are read on a thread of their own (started on first use): a slow read
        #: delays neither the steps nor other requests' encodes and decodes
        self._loader: ThreadPoolExecutor | None = None
        self._overlap = overlap
        if overlap:
            # the side thread must use the same torch thread count as the stepping thread
            self._side = ThreadPoolExecutor(max_workers=1, thread_name_prefix="diffserve-stage",
                                            initializer=torch.set_num_threads, initargs=(torch.get_num_threads(),))

    def submit(self, out: SchedulerOutput) -> list[tuple[WorkItem, Future]]:
        """Free `out.finished_ids`, take the snapshots its decodes read (now, before the next
        step), and queue its background work; returns each work item with its future."""
        runner = self.runner
        if out.finished_ids:
            runner.free(list(out.finished_ids))
        if not (out.previews or out.decodes or out.chunks or out.new_requests):
            return []
        submitted = []
        for item in work_items(out):
            if item.kind == PREPARE:
                for new in item.payload:  # multi-stage: the payloads' fetch starts now, beside the steps
                    if new.context is not None:
                        runner.prefetch(new.request_id, new.context, new.params)
                future = self._submit(runner.prepare, item.payload)
            elif item.kind == CHUNK:
                future = self._submit(self._chunk, [item.payload])
            else:
                preview = item.kind == PREVIEW
                snapshots = runner.snapshot(item.request_ids) if self.is_driver else None
                future = self._submit(self._decode, item.request_ids, preview, snapshots)
            submitted.append((item, future))
        return submitted

    def step(self, request_ids: list[str]) -> StepOutput:
        """ONE denoising step (on the calling thread)."""
        return self.runner.step(request_ids)

    def load_lora(self, name: str, path: str) -> Future:
        """Read the LoRA adapter at `path` into the runner as `name`, beside the steps (inline
        without overlap); resolves to its summary or the runner's error."""
        if not self._overlap:
            return self._submit(self.runner.load_lora, name, path)
        if self._loader is None:
            self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="diffserve-lora",
                                              initializer=torch.set_num_threads, initargs=(torch.get_num_threads(),))
        return self._loader.submit(self.runner.load_lora, name, path)

    def unload_lora(self, name: str) -> None:
        """Drop adapter `name` from the runner."""
        self.runner.unload_lora(name)

    def _decode(self, request_ids: list[str], preview: bool, snapshots: dict | None) -> list:
        if not self.is_driver:  # only rank 0 decodes; the others just free
            if not preview:
                self.runner.free(request_ids)
            return []
        return self.runner.decode(request_ids, preview, snapshots)

    def _chunk(self, works: list) -> list:
        results = self.runner.chunk(works)
        if not self.is_driver:  # rank 0 answers for the media; the others only keep in step
            results = [dataclasses.replace(r, frames=None, video=None) for r in results]
        return results

    def _submit(self, fn: Callable[..., Any], *args) -> Future:
        if self._side is not None:
            return self._side.submit(fn, *args)
        future: Future = Future()
        try:
            future.set_result(fn(*args))
        except BaseException as exc:  # noqa: BLE001 - delivered through the future
            future.set_exception(exc)
        return future

    def shutdown(self) -> None:
        """Let queued background work finish, then stop the side thread (idempotent)."""
        if self._side is not None:
            self._side.shutdown(wait=True, cancel_futures=False)
            self._side = None
        if self._loader is not None:
            self._loader.shutdown(wait=True, cancel_futures=True)
            self._loader = None
