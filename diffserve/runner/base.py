"""`Runner`: the one interface of a worker's runner (vLLM's ``WorkerBase``).

Both runners implement it: `ModelRunner` (a step adapter: step-level batching) and
`WholeRequestRunner` (any other pipeline class, whole requests one step at a time). The
executor and `diffserve.runner.worker.Worker` call only what is declared here, so a capability a
runner lacks is a method with a stated default (no chunk streaming, no offload counters, no
memory profile), never an attribute probe.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from diffserve.core.messages import (
    ChunkDone,
    ChunkWork,
    Decoded,
    MemoryProfile,
    ModelInfo,
    NewRequest,
    Prepared,
    RequestPlan,
    StepOutput,
    WorkError,
)
from diffserve.core.sampling_params import SamplingParams


class Runner(ABC):
    """Runs the work items of the executor boundary on one loaded model (see the module
    docstring). Requests are keyed by id; a failing request is isolated from the others.

    Attributes:
        nonfinite_count: requests failed for NaN / inf outputs so far.
    """

    nonfinite_count: int = 0

    # ------------------------------------------------------------------ model facts
    @abstractmethod
    def info(self) -> ModelInfo:
        """The loaded model's spec, pipeline class and capabilities."""

    @abstractmethod
    def plan(self, params: SamplingParams, inputs: Any = None) -> RequestPlan:
        """Rows, batch key and denoising steps of a request with resolved `params`.

        Raises:
            InvalidRequestError: a field the model cannot honour (named).
        """

    # ------------------------------------------------------------------ work items
    @abstractmethod
    def prepare(self, requests: list[NewRequest]) -> list[Prepared]:
        """Create each request's state (prompt encoding, latents, diffusion scheduler); a
        failure is that request's alone (its `Prepared.error`)."""

    @abstractmethod
    def step(self, request_ids: list[str]) -> StepOutput:
        """ONE denoising step of `request_ids` (one batch key); failed requests are freed."""

    @abstractmethod
    def snapshot(self, request_ids: list[str]) -> dict[str, Any]:
        """What a later `decode` of these requests reads, taken now (before the next step moves
        their latents on); may be empty where decodes need none."""

    @abstractmethod
    def decode(self, request_ids: list[str], preview: bool = False,
               snapshots: dict[str, Any] | None = None) -> list[Decoded]:
        """Decode requests into their output type: a final decode frees each request, a
        preview (``preview=True``) leaves it running."""

    def chunk(self, works: list[ChunkWork]) -> list[ChunkDone]:
        """End streams' chunks (decode each, prepare the next one). This runner streams no
        chunks (`ModelInfo.chunk_streaming` is False, so the engine refuses ``num_chunks``):
        each work item fails and its request is freed."""
        self.free([w.request_id for w in works])
        return [ChunkDone(w.request_id, error=WorkError("NotImplementedError",
                                                        f"{type(self).__name__} cannot stream video chunks"))
                for w in works]

    @abstractmethod
    def free(self, request_ids: list[str]) -> None:
        """Drop requests' state (unknown ids are ignored)."""

    # ------------------------------------------------------------------ LoRA adapters
    def load_lora(self, name: str, path: str) -> dict[str, Any]:
        """Read the LoRA adapter at `path` as `name`; its summary (format, rank, modules,
        bytes).

        Raises:
            InvalidRequestError: (field ``path``) the file does not load or match the model.
            NotImplementedError: this runner takes no LoRA adapters.
        """
        raise NotImplementedError(f"{type(self).__name__} does not load LoRA adapters")

    def unload_lora(self, name: str) -> None:
        """Forget adapter `name` (no request may hold it)."""
        raise NotImplementedError(f"{type(self).__name__} does not load LoRA adapters")

    # ------------------------------------------------------------------ stats and memory
    def prefetch(self, request_id: str, handle: Any, params: SamplingParams) -> None:
        """Multi-stage models: start fetching an admitted request's AR-stage payloads (its
        `diffserve.connector.PayloadHandle`) beside the steps; its `prepare` then waits only for
        what is left. Single-stage runners receive none (default: nothing to do)."""

    def payload_stats(self) -> dict[str, Any] | None:
        """Multi-stage models: the DiT side's payload counters and its connector's accounting
        (`diffserve.runner.payload_receiver.PayloadReceiver.stats`); None otherwise."""
        return None

    @abstractmethod
    def acceleration_stats(self) -> dict[str, Any]:
        """Acceleration counters (prompt-embedding cache, cache backend, compile)."""

    @abstractmethod
    def peak_memory_bytes(self) -> int:
        """CUDA allocator peak on GPU; process peak RSS on CPU (bytes)."""

    def offload_stats(self) -> dict[str, Any] | None:
        """Offload placement and counters (`diffserve.runner.model_memory.ModelMemory.stats`);
        None where the runner does not place components itself."""
        return None

    def memory_profile(self) -> MemoryProfile | None:
        """The model's memory profile for memory-aware admission; None where the runner
        cannot budget memory."""
        return None

    @abstractmethod
    def sleep(self, level: int) -> None:
        """Sleep mode with no request held: level 1 moves the weights off the device, level 2
        discards them.

        Raises:
            InvalidRequestError: `level` is not 1 or 2.
        """

    @abstractmethod
    def wake_up(self) -> None:
        """Restore the weights put to sleep (no-op while awake)."""
