"""What the engine hands back: per-request outputs, metrics and stream events."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any


@dataclass
class RequestMetrics:
    """Timings and resource use of one request.

    All durations are wall-clock seconds. ``denoise_s`` runs from the start of the request's
    first denoising step to the end of its last one (so in step mode it includes steps spent
    on other batches). ``peak_memory_bytes`` is the CUDA allocator peak on GPU, and the
    process peak RSS on CPU, read when the request ends (a process-wide peak, not this
    request's share).

    ``request_peak_memory_bytes`` is the request's own peak: the most memory any of its
    denoising steps used above the resident model (CUDA: allocator peak during the step minus
    the weights on the device; CPU: process RSS high-water mark during the step minus the RSS
    of the idle loaded engine, page-granular, including what other threads allocated
    meanwhile); None where it cannot be measured. Rows of other requests in the same step
    count too: they share the forward. ``offload_loads`` counts the components moved onto the
    device for the work items this request took part in (model CPU offload; one move can
    serve many requests).

    Streams (``num_chunks``): ``chunk_s`` holds, per chunk, the seconds from arrival to its
    chunk event (so ``chunk_s[0]`` is the time to first chunk and consecutive differences are
    the inter-chunk gaps); ``decode_s`` adds up the chunk boundaries (decode of a chunk and
    preparation of the next).

    Multi-stage models (an AR stage before the DiT): ``ar_queue_s`` from arrival to the start
    of the request's AR generation; ``ar_s`` its generation (wall time of the batched rounds or
    continuous-batching steps it took part in); ``transfer_s`` making and putting its payloads
    (the AR side's K/V export, one batched forward) plus fetching them on the DiT side (mapping
    or referencing, and moving to the device); ``payload_wait_s`` how long the DiT stage's prepare
    waited for that fetch (the fetch starts at admission, so ~0 when it finished in time);
    ``payload_bytes`` the bytes of its payloads (all guidance branches). ``queue_s`` then counts
    from the end of the AR stage to DiT admission. All 0 for single-stage models.

    Step caching (engines with a cache backend that keeps per-request records, ``teacache``):
    ``cache_quality`` the request's level (`SamplingParams.cache_quality`, resolved to the
    engine's default; ``"custom"``: plain TeaCache at the engine's threshold),
    ``cache_skipped_steps`` the denoising steps whose transformer blocks were skipped,
    ``cache_error_estimate`` the run-time guard's final estimate of the relative error
    skipping put into the result (`diffserve.acceleration.cache_guard`), ``cache_check_steps``
    the computed steps that measured the forecast's error. None / 0 otherwise.
    ``preemptions`` counts the step boundaries at which the ``priority`` / ``slo`` scheduling
    policy left the request out of a step it had been running in; ``deadline_met`` is whether it
    finished within its ``deadline_s`` (None without a deadline).
    """

    arrival_time: float = 0.0
    queue_s: float = 0.0
    encode_s: float = 0.0
    denoise_s: float = 0.0
    decode_s: float = 0.0
    total_s: float = 0.0
    num_steps: int = 0
    batch_sizes: dict[int, int] = field(default_factory=dict)
    peak_memory_bytes: int = 0
    request_peak_memory_bytes: int | None = None
    offload_loads: int = 0
    chunk_s: list[float] = field(default_factory=list)
    ar_queue_s: float = 0.0
    ar_s: float = 0.0
    transfer_s: float = 0.0
    payload_wait_s: float = 0.0
    payload_bytes: int = 0
    cache_quality: str | None = None
    cache_skipped_steps: int = 0
    cache_error_estimate: float | None = None
    cache_check_steps: int = 0
    preemptions: int = 0
    deadline_met: bool | None = None

    @property
    def first_chunk_s(self) -> float | None:
        """Time to first chunk (streams): seconds from arrival to the first chunk event."""
        return self.chunk_s[0] if self.chunk_s else None

    def as_dict(self) -> dict[str, Any]:
        """Plain dict (JSON-serialisable) of the metrics."""
        return {
            "queue_s": self.queue_s,
            "encode_s": self.encode_s,
            "denoise_s": self.denoise_s,
            "decode_s": self.decode_s,
            "total_s": self.total_s,
            "num_steps": self.num_steps,
            "batch_sizes": {str(k): v for k, v in sorted(self.batch_sizes.items())},
            "peak_memory_bytes": self.peak_memory_bytes,
            "request_peak_memory_bytes": self.request_peak_memory_bytes,
            "offload_loads": self.offload_loads,
            **({"chunk_s": list(self.chunk_s)} if self.chunk_s else {}),
            **({"preemptions": self.preemptions} if self.preemptions else {}),
            **({"deadline_met": self.deadline_met} if self.deadline_met is not None else {}),
            **({"ar_queue_s": self.ar_queue_s, "ar_s": self.ar_s, "transfer_s": self.transfer_s,
                "payload_wait_s": self.payload_wait_s, "payload_bytes": self.payload_bytes}
               if self.payload_bytes else {}),
            **({"cache_quality": self.cache_quality, "cache_skipped_steps": self.cache_skipped_steps,
                "cache_error_estimate": self.cache_error_estimate, "cache_check_steps": self.cache_check_steps}
               if self.cache_quality is not None else {}),
        }


class RequestStatus(str, Enum):
    """Lifecycle of a request."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"
    ABORTED = "aborted"

    @property
    def is_final(self) -> bool:
        return self in (RequestStatus.FINISHED, RequestStatus.FAILED, RequestStatus.ABORTED)


@dataclass
class GenerationOutput:
    """Result of one request.

    Attributes:
        images: image models: per `SamplingParams.output_type`, a list of PIL images, a
            float32 numpy array (N, H, W, C) in [0, 1], a float tensor (N, C, H, W) in [0, 1],
            or latents. Empty when the request failed or was aborted, and for video models.
        videos: video models: one entry per video (``num_images_per_prompt`` videos): a list
            of PIL frames (``"pil"``), a uint8 numpy array (F, H, W, 3) (``"np"``), a uint8
            tensor (F, H, W, 3) (``"pt"``), or latents. Empty for image models.
        seed: the seed actually used (reproduces the images).
        prompt_truncated / negative_prompt_truncated: that text was longer than a text
            encoder's limit and was cut.
        status: finished, failed or aborted; `error` holds the message when failed and
            `error_type` the failure's class name (e.g. ``"NonFiniteOutputError"``);
            `error_param` names the request field when the request itself proved invalid after
            it was queued (an `InvalidRequestError`, e.g. ``loras`` naming an adapter whose file
            failed to load): the HTTP server answers 400 naming it, not 500.
        params: the resolved sampling params the request ran with (defaults filled in).
        ar_text: multi-stage models whose AR stage writes text (the built-in
            ``digits-reasoning``: the language model's answer): that text; None otherwise.
    """

    request_id: str
    prompt: str
    images: Any
    seed: int
    status: RequestStatus
    metrics: RequestMetrics
    prompt_truncated: bool = False
    error: str | None = None
    negative_prompt_truncated: bool = False
    error_type: str | None = None
    error_param: str | None = None
    params: Any = None
    videos: Any = field(default_factory=list)
    ar_text: str | None = None

    @property
    def ok(self) -> bool:
        return self.status is RequestStatus.FINISHED


class EventType(str, Enum):
    """Kinds of stream events a request yields, in order: queued, ar_delta* (multi-stage
    models whose AR stage writes text: each new piece of it, as generated), started,
    progress*, partial*, then exactly one of finished / failed / aborted. A stream
    (``num_chunks``) interleaves one ``chunk`` event per chunk (in chunk order) with the progress
    events of the chunks; its last chunk event comes right before ``finished``."""

    QUEUED = "queued"
    AR_DELTA = "ar_delta"
    STARTED = "started"
    PROGRESS = "progress"
    PARTIAL = "partial"
    CHUNK = "chunk"
    FINISHED = "finished"
    FAILED = "failed"
    ABORTED = "aborted"

    @property
    def is_final(self) -> bool:
        return self in (EventType.FINISHED, EventType.FAILED, EventType.ABORTED)


@dataclass
class StreamEvent:
    """One event of a request.

    Attributes:
        step / total: denoising steps done and planned (progress events; of the current chunk
            for streams).
        preview: decoded preview of the current latents (partial events), as `output_type`.
        output: the final output (finished, failed and aborted events); for chunk events the
            chunk's new frames, a uint8 numpy array (F, H, W, 3) (the first chunk has
            ``num_frames`` frames, later ones leave out the frames they repeat from the
            previous chunk, see `diffserve.pipelines.video_chunks`).
        error: message (failed events).
        chunk_index: the chunk (0-based) a chunk event carries, or a progress event steps.
        event_ids: chunk events: the ``event_id`` of every interaction
            (`DiffusionEngine.submit_interaction`) this chunk is the first to use.
        text: ar_delta events: the new piece of the AR stage's text.
    """

    request_id: str
    type: EventType
    step: int | None = None
    total: int | None = None
    preview: Any = None
    output: Any = None
    error: str | None = None
    chunk_index: int | None = None
    event_ids: list[str] = field(default_factory=list)
    text: str | None = None
