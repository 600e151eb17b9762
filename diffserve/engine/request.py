"""`Request`: one generation request as the engine tracks it through its lifecycle."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from diffserve.core.messages import Interaction
from diffserve.core.outputs import RequestMetrics, RequestStatus, StreamEvent
from diffserve.core.sampling_params import SamplingParams


class Phase(str, Enum):
    """Where a request is: in its model's AR stage (multi-stage models: generating what the
    DiT stage reads, before it joins the waiting queue), waiting in the queue, being prepared
    (encode), denoising (stepped by the request scheduler), between two chunks of a stream (its
    chunk is decoded and the next one prepared; it keeps its rows), being decoded, or done."""

    AR_STAGE = "ar_stage"
    WAITING = "waiting"
    PREPARING = "preparing"
    DENOISING = "denoising"
    BETWEEN_CHUNKS = "between_chunks"
    DECODING = "decoding"
    DONE = "done"


@dataclass
class Request:
    """A request inside the engine (plain data: its tensors live in the workers).

    Attributes:
        params: resolved (validated, defaults filled) sampling params.
        inputs: input images / mask (`diffserve.pipelines.base.RequestInputs`) or None.
        batch_key: the adapter's key; requests with equal keys can share a denoising step.
        step_key: the part of the key that changes while the request runs (e.g. Wan 2.2's
            expert), as the worker last reported it; batches also share it.
        rows: denoiser rows per step (images x guidance branches).
        seq: arrival sequence number (the request scheduler's age order).
        num_steps / steps_done: planned and completed denoising steps (planned from the
            executor's `RequestPlan`, confirmed once prepared).
        preview_steps: steps after which a decoded preview is streamed (partial events).
        memory_bytes: estimated bytes the request needs while running (memory-aware
            admission, `diffserve.engine.memory_budget`; 0 without a memory budget).
        token_bytes: the part of `memory_bytes` proportional to its image tokens
            (`slot_bytes` per token slot; 0 without a memory budget).
        listener: called with each of the request's events on the stepping thread (instead of
            returning them from `DiffusionEngine.step`); how `generate` and the async engine
            receive their events whichever thread steps.
        progress: whether the request emits a ``progress`` event after every denoising step
            (False: only its other events; what a caller that waits for the result alone asks,
            so a step's bookkeeping does not create and route one event per request).
        chunk_index: streams: the chunk being denoised (or whose boundary work is in flight).
        interactions: streams: interactions received and not yet sent to the workers (they go
            with the next chunk boundary's `ChunkWork`).
        context: multi-stage models: the `diffserve.connector.PayloadHandle` of the payloads its
            AR stage produced (set when the AR stage finishes; sent to the workers at admission).
        ar_text: multi-stage models: the AR stage's text (`GenerationOutput.ar_text`).
        ar_end_time: ``time.perf_counter()`` when its AR stage finished (its DiT queue time
            counts from there).
        tokens: image tokens its rows put in a forward (rows x the tokens of its size: height /
            f x width / f, f the model's resolution factor, x latent frames); what the step
            cost model and the tokens-per-forward metric count.
        grid: one row's token grid where a forward pads each axis on its own (video: (latent
            frames, height / f, width / f)); () where rows pad to the longest token sequence
            (`row_grid`).
    """

    request_id: str
    prompt: str
    params: SamplingParams
    batch_key: Hashable
    rows: int
    seq: int
    arrival_time: float
    inputs: Any = None
    phase: Phase = Phase.WAITING
    num_steps: int = 0
    steps_done: int = 0
    prompt_truncated: bool = False
    negative_prompt_truncated: bool = False
    status: RequestStatus = RequestStatus.WAITING
    abort_requested: bool = False
    first_step_time: float | None = None
    preview_steps: frozenset[int] = frozenset()
    listener: Callable[[StreamEvent], None] | None = None
    progress: bool = True
    memory_bytes: int = 0
    token_bytes: int = 0
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    step_key: Hashable = None
    chunk_index: int = 0
    interactions: list[Interaction] = field(default_factory=list)
    context: Any = None
    ar_text: str | None = None
    ar_end_time: float | None = None
    tokens: int = 0
    grid: tuple[int, ...] = ()

    @property
    def row_tokens(self) -> int:
        """Image tokens of one of its rows (`tokens` / `rows`)."""
        return self.tokens // self.rows if self.rows > 0 else self.tokens

    @property
    def row_grid(self) -> tuple[int, ...]:
        """The token grid one of its rows pads to the batch's largest of, axis by axis (the
        padding cap of `diffserve.engine.queues`): `grid`, or ``(row_tokens,)`` (one axis: a
        sequence padded to the longest)."""
        return self.grid or (self.row_tokens,)

    @property
    def slot_bytes(self) -> int:
        """Estimated activation bytes of one image-token slot of its rows (`token_bytes` /
        `tokens`, rounded up; 0 without either): what each slot of padding costs when a
        mixed-size forward pads its rows to a wider one."""
        return -(-self.token_bytes // self.tokens) if self.tokens > 0 else 0

    @property
    def lora_names(self) -> tuple[str, ...]:
        """Names of the LoRA adapters the request uses (``params.loras``)."""
        loras = self.params.loras if self.params is not None else None
        return tuple(loras) if loras else ()

    @property
    def remaining_steps(self) -> int:
        """Denoising steps it has left: those of the current chunk (`num_steps` - `steps_done`)
        and, for a stream, `num_steps` for each chunk after it (its ``deadline_s`` covers the
        whole stream); what the ``slo`` policy's slack and ``--admission slo`` count."""
        left = max(self.num_steps - self.steps_done, 0)
        if self.params is not None and self.params.num_chunks is not None:
            left += max(self.params.num_chunks - self.chunk_index - 1, 0) * self.num_steps
        return left

    @property
    def streaming(self) -> bool:
        """A stream of video chunks (``params.num_chunks`` set)."""
        return self.params.num_chunks is not None
