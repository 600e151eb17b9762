"""`InProcessExecutor`: one runner in the engine's process, driven through a
`diffserve.runner.worker.Worker` (denoising steps on the calling thread; prepare and decode on
one side thread beside them, or inline with ``overlap_stages=False``)."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any

from diffserve.core.messages import ModelInfo, RequestPlan, SchedulerOutput, StepOutput
from diffserve.core.sampling_params import SamplingParams
from diffserve.executor.base import Executor
from diffserve.runner import build_runner
from diffserve.runner.base import Runner
from diffserve.runner.worker import WorkItem, Worker


class InProcessExecutor(Executor):
    """Runs a `Runner` in this process.

    Args:
        config: engine configuration (``overlap_stages`` picks the side thread).
        runner: an existing runner (`ModelRunner` or `WholeRequestRunner`) to drive instead of
            loading ``config.model``.
    """

    def __init__(self, config, runner: Runner | None = None):
        super().__init__()
        self.worker = Worker(runner or build_runner(config), overlap=config.overlap_stages)
        self._plan_lock = threading.Lock()

    @property
    def runner(self) -> Runner:
        return self.worker.runner

    def _submit(self, out: SchedulerOutput) -> list[tuple[WorkItem, Future]]:
        return self.worker.submit(out) if out.has_work else []

    def _step(self, request_ids: list[str]) -> StepOutput:
        return self.worker.runner.step(request_ids)

    def submit_load_lora(self, name: str, path: str) -> "Future[dict[str, Any]]":
        return self.worker.load_lora(name, path)

    def unload_lora(self, name: str) -> None:
        self.worker.unload_lora(name)

    def info(self) -> ModelInfo:
        return self.worker.runner.info()

    def plan(self, params: SamplingParams, inputs: Any = None) -> RequestPlan:
        with self._plan_lock:
            return self.worker.runner.plan(params, inputs)

    def stats(self) -> dict[str, Any]:
        """``acceleration`` (`Runner.acceleration_stats`), ``nonfinite_outputs`` (requests
        failed for NaN/inf), ``workers_alive`` (1) and ``offload`` (`Runner.offload_stats`,
        where the runner places components itself) and ``payloads`` (multi-stage models:
        `Runner.payload_stats`)."""
        runner = self.worker.runner
        stats = {"acceleration": runner.acceleration_stats(), "nonfinite_outputs": runner.nonfinite_count,
                 "workers_alive": 1}
        offload = runner.offload_stats()
        if offload is not None:
            stats["offload"] = offload
        payloads = runner.payload_stats()
        if payloads is not None:
            stats["payloads"] = payloads
        return stats

    def memory_profile(self):
        return self.worker.runner.memory_profile()

    def sleep(self, level: int) -> None:
        self.worker.runner.sleep(level)

    def wake_up(self) -> None:
        self.worker.runner.wake_up()

    def peak_memory_bytes(self) -> int:
        return self.worker.runner.peak_memory_bytes()

    def shutdown(self) -> None:
        self.worker.shutdown()
