"""`InProcessExecutor`: one `ModelRunner` in the engine's process.

Denoising steps run on the calling (engine) thread. Prepare and decode work runs on one side
thread, overlapping the steps: torch releases the GIL inside its ops, so a long prompt encode or
video decode uses another core (on CPU) or overlaps the step loop's host work (on GPU: the side
thread's kernels share the default stream, so the GPU work itself is serialized, which keeps
ordering trivially correct). With ``overlap=False`` everything runs inline on the calling
thread, in submission order (deterministic interleaving, for tests and baselines).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable

import torch

from diffserve.executor.base import Executor
from diffserve.core.messages import (
    ChunkDone,
    ChunkWork,
    Decoded,
    ModelInfo,
    NewRequest,
    Prepared,
    RequestPlan,
    StepOutput,
)
from diffserve.runner import build_runner
from diffserve.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from diffserve.runner.model_runner import ModelRunner


class InProcessExecutor(Executor):
    """Runs a `ModelRunner` in this process.

    Args:
        config: engine configuration (``overlap_stages`` picks the side thread).
        runner: an existing runner (`ModelRunner` or `WholeRequestRunner`) to drive instead of
            loading ``config.model``.
    """

    def __init__(self, config, runner: "ModelRunner | None" = None):
        self.runner = runner or build_runner(config)
        self.overlap = config.overlap_stages
        self._side: ThreadPoolExecutor | None = None
        self._plan_lock = threading.Lock()
        if self.overlap:
            # the side thread must use the same torch thread count as the engine thread
            threads = torch.get_num_threads()
            self._side = ThreadPoolExecutor(max_workers=1, thread_name_prefix="diffserve-stage",
                                            initializer=torch.set_num_threads, initargs=(threads,))

    def info(self) -> ModelInfo:
        return self.runner.info()

    def plan(self, params: SamplingParams, inputs: Any = None) -> RequestPlan:
        with self._plan_lock:
            return self.runner.plan(params, inputs)

    def _submit(self, fn: Callable[..., Any], *args) -> Future:
        if self._side is not None:
            return self._side.submit(fn, *args)
        future: Future = Future()
        try:
            future.set_result(fn(*args))
        except BaseException as exc:  # noqa: BLE001 - delivered through the future
            future.set_exception(exc)
        return future

    def submit_prepare(self, requests: list[NewRequest]) -> "Future[list[Prepared]]":
        return self._submit(self.runner.prepare, requests)

    def step(self, request_ids: list[str]) -> StepOutput:
        return self.runner.step(request_ids)

    def submit_decode(self, request_ids: list[str], preview: bool = False) -> "Future[list[Decoded]]":
        snapshots = self.runner.snapshot(request_ids)  # now, on the stepping thread
        return self._submit(self.runner.decode, request_ids, preview, snapshots)

    def submit_chunk(self, works: list[ChunkWork]) -> "Future[list[ChunkDone]]":
        return self._submit(self.runner.chunk, works)

    def free(self, request_ids: list[str]) -> None:
        self.runner.free(request_ids)

    def stats(self) -> dict[str, Any]:
        """``acceleration`` (`ModelRunner.acceleration_stats`), ``nonfinite_outputs`` (requests
        failed for NaN/inf), ``workers_alive`` (1) and ``offload`` (`ModelRunner.offload_stats`,
        when the runner has one)."""
        stats = {"acceleration": self.runner.acceleration_stats(),
                 "nonfinite_outputs": self.runner.nonfinite_count, "workers_alive": 1}
        if hasattr(self.runner, "offload_stats"):
            stats["offload"] = self.runner.offload_stats()
        return stats

    def memory_profile(self):
        profile = getattr(self.runner, "memory_profile", None)
        return profile() if profile is not None else None

    def sleep(self, level: int) -> None:
        self.runner.sleep(level)

    def wake_up(self) -> None:
        self.runner.wake_up()

    def peak_memory_bytes(self) -> int:
        return self.runner.peak_memory_bytes()

    def shutdown(self) -> None:
        if self._side is not None:
            self._side.shutdown(wait=True, cancel_futures=False)
            self._side = None
