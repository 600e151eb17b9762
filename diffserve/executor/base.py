"""`Executor`: the interface between the engine and the workers that run the model."""

from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import Future
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
)
from diffserve.core.sampling_params import SamplingParams


class Executor(ABC):
    """Runs work items on the model. Denoising steps are synchronous (the engine's loop paces
    them); prepare (prompt encoding, latents) and decode (VAE) are submitted and complete in
    the background where the executor can overlap them with steps, so a long encode or video
    decode does not stall every running request's step.

    Threading: one engine thread calls `step` / `submit_*` / `free` at a time.
    """

    @abstractmethod
    def info(self) -> ModelInfo:
        """The loaded model's spec and pipeline class."""

    @abstractmethod
    def plan(self, params: SamplingParams, inputs: Any = None) -> RequestPlan:
        """Rows and batch key of a request (raises InvalidRequestError for fields the family
        cannot honour). Thread-safe."""

    @abstractmethod
    def submit_prepare(self, requests: list[NewRequest]) -> "Future[list[Prepared]]":
        """Prepare requests (encode, latents, scheduler)."""

    @abstractmethod
    def step(self, request_ids: list[str]) -> StepOutput:
        """One denoising step for requests sharing a batch key."""

    @abstractmethod
    def submit_decode(self, request_ids: list[str], preview: bool = False) -> "Future[list[Decoded]]":
        """Decode requests whose denoising finished (frees them), or previews of running ones."""

    def submit_chunk(self, works: list[ChunkWork]) -> "Future[list[ChunkDone]]":
        """End streams' chunks (decode each, prepare the next chunk with the work's
        interactions; the last chunk frees its stream), in the background like a decode.

        Raises:
            NotImplementedError: this executor does not forward chunk work (streams are then
                refused: `ModelInfo.chunk_streaming` must be False).
        """
        raise NotImplementedError(f"{type(self).__name__} does not run video chunk work")

    @abstractmethod
    def free(self, request_ids: list[str]) -> None:
        """Drop requests' state (aborted / failed)."""

    @abstractmethod
    def stats(self) -> dict[str, Any]:
        """Acceleration counters and worker health (see `InProcessExecutor.stats`)."""

    @abstractmethod
    def peak_memory_bytes(self) -> int:
        """Device allocator peak (GPU) or process peak RSS (CPU), bytes."""

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
