"""Plain data crossing the executor boundary (engine <-> workers).

The engine never touches tensors or the runner's per-request state. Every engine tick the
request scheduler hands the workers ONE `SchedulerOutput` (like vLLM's): the requests to
prepare (`NewRequest`), the ids of this tick's denoising step, the decodes, previews and chunk
boundaries (`ChunkWork`, with the `Interaction` s it applies from the next chunk on) to run
beside the steps, and the ids to free. The workers answer with a `RunnerOutput`: the step's
`StepOutput` and whatever background work completed meanwhile (`Prepared`, `Decoded`,
`ChunkDone`). Everything here is picklable (tensors inside `NewRequest.inputs` and
`Decoded.output` are CPU tensors / arrays / PIL images), so a worker can live in another
process.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from diffserve.core.sampling_params import ModelSpec, SamplingParams


@dataclass(frozen=True)
class WorkError:
    """A request's failure inside a worker.

    Attributes:
        type: the exception class name (e.g. ``"NonFiniteOutputError"``).
        message: its message.
    """

    type: str
    message: str

    @classmethod
    def of(cls, exc: BaseException) -> "WorkError":
        return cls(type(exc).__name__, str(exc))

    def __str__(self) -> str:
        return f"{self.type}: {self.message}"


@dataclass
class NewRequest:
    """A request to prepare (encode its prompt, draw latents, create its scheduler).

    Attributes:
        params: resolved sampling params.
        inputs: `diffserve.core.inputs.RequestInputs` (input images / mask) or None.
        context: multi-stage models: the `diffserve.connector.PayloadHandle` of the payloads its
            AR stage produced (the runner receives them before preparing); None otherwise.
    """

    request_id: str
    prompt: str
    params: SamplingParams
    inputs: Any = None
    context: Any = None


@dataclass
class Prepared:
    """Outcome of preparing one request.

    Attributes:
        num_steps: denoising steps it will run (its timesteps).
        seconds: wall-clock seconds of the encode + latent preparation.
        error: set when preparing failed (the request is gone from the worker).
        step_key: the adapter's step key for its first step (`PipelineAdapter.step_key`).
        offload_loads: components moved onto the device for the work item that prepared it
            (model CPU offload; one move serves every request of the item).
        payload_wait_s / payload_fetch_s / payload_bytes: multi-stage models: how long the
            prepare waited for the request's AR-stage payloads, how long fetching them took
            (from admission), and their size in bytes.
    """

    request_id: str
    num_steps: int = 0
    prompt_truncated: bool = False
    negative_prompt_truncated: bool = False
    seconds: float = 0.0
    error: WorkError | None = None
    step_key: Any = None
    offload_loads: int = 0
    payload_wait_s: float = 0.0
    payload_fetch_s: float = 0.0
    payload_bytes: int = 0


@dataclass
class StepOutput:
    """Outcome of one denoising step over a batch.

    Attributes:
        num_rows: denoiser rows in the forward (all requests, guidance branches included); the
            largest forward's when requests had to run alone.
        request_rows: request_id -> rows of the forward it took part in, when requests ran in
            forwards of their own (a cache backend that cannot share forwards, or the retry of a
            failed shared step); empty when all shared one forward of `num_rows`.
        steps_done: request_id -> denoising steps done after this step, for the requests whose
            count is not simply one more (the whole-request runner reports its own); a request
            that stepped and is absent advanced by one step.
        errors: request_id -> failure (those requests are gone from the worker).
        num_steps: request_id -> its total denoising steps, when the worker learned it only
            while running (whole-request pipelines: img2img strength shortens the schedule).
        seconds: wall-clock seconds of the step.
        step_keys: request_id -> the adapter's step key for its next step (requests that
            stepped; `PipelineAdapter.step_key`).
        peak_memory_bytes: memory the step used at its peak above the resident model (see
            `ModelRunner.step`), bytes; None where it cannot be measured.
        offload_loads: components moved onto the device for this step (model CPU offload).
    """

    num_rows: int = 0
    request_rows: dict[str, int] = field(default_factory=dict)
    steps_done: dict[str, int] = field(default_factory=dict)
    num_steps: dict[str, int] = field(default_factory=dict)
    errors: dict[str, WorkError] = field(default_factory=dict)
    seconds: float = 0.0
    step_keys: dict[str, Any] = field(default_factory=dict)
    peak_memory_bytes: int | None = None
    offload_loads: int = 0


@dataclass
class Decoded:
    """A decoded request (final output or preview).

    Attributes:
        output: media of the request's output_type (images, or video frames), None on error.
        step: denoising steps done when the latents were taken (previews).
        preview: True for a preview (the request keeps running).
        seconds: wall-clock seconds of the decode.
        offload_loads: components moved onto the device for the decode work item.
        cache: a final decode's record of the request's step caching (``cache_quality``,
            ``skipped_steps``, ``error_estimate``, ``check_steps``; the cache backend's
            ``request_summary``), None without one.
    """

    request_id: str
    output: Any = None
    step: int = 0
    preview: bool = False
    seconds: float = 0.0
    error: WorkError | None = None
    offload_loads: int = 0
    cache: dict[str, Any] | None = None


@dataclass(frozen=True)
class Interaction:
    """A prompt change for a running stream (`DiffusionEngine.submit_interaction`).

    Attributes:
        prompt: the new prompt (validated).
        transition_chunks: chunks over which the conditioning moves from the previous prompt
            to the new one (0: the next chunk uses the new prompt alone).
        event_id: the client's id, echoed on the first chunk that uses the new prompt.
    """

    prompt: str
    transition_chunks: int
    event_id: str


@dataclass
class ChunkWork:
    """End a stream's chunk whose denoising finished: decode it and, unless it was the last,
    prepare the next chunk (conditioned on this one) with `interactions` applied from it on."""

    request_id: str
    interactions: list[Interaction] = field(default_factory=list)


@dataclass
class ChunkDone:
    """Outcome of a `ChunkWork`.

    Attributes:
        chunk_index: the chunk that was decoded (0-based).
        frames: its new frames, uint8 numpy (F, H, W, 3).
        video: with the last chunk: the whole video (all chunks' frames) as the request's
            ``output_type``; None otherwise (the request then keeps running, freed with it).
        event_ids: event ids of the interactions this chunk is the first to use.
        num_steps / step_key: the next chunk's denoising steps and first step key.
        seconds: wall-clock seconds of the work (decode + next chunk's preparation).
        error: set when it failed (the request is gone from the worker).
        offload_loads: components moved onto the device for the work item.
    """

    request_id: str
    chunk_index: int = 0
    frames: Any = None
    video: Any = None
    event_ids: list[str] = field(default_factory=list)
    num_steps: int = 0
    step_key: Any = None
    seconds: float = 0.0
    error: WorkError | None = None
    offload_loads: int = 0


@dataclass(frozen=True)
class RequestPlan:
    """What the request scheduler needs to know about a request: its denoiser rows per step,
    its batch key (requests with equal keys may share a forward) and the denoising steps it
    will run (fewer than ``num_inference_steps`` for image-to-image with strength < 1)."""

    rows: int
    batch_key: Any
    num_steps: int


@dataclass(frozen=True)
class ModelInfo:
    """The loaded model as the engine sees it.

    Attributes:
        spec: defaults and limits for validation.
        pipeline: the diffusers pipeline class name.
        step_batching: whether requests run step by step (False: whole-request fallback).
        chunk_streaming: whether requests may stream video chunks (``num_chunks``) and take
            interactions.
        quantization: the quantized components, plain data (``{"spec": ..., "components":
            {name: report}}``, `diffserve.core.quantization.ComponentReport.as_dict`), None when
            nothing is quantized.
        ar_stage: whether the model has an autoregressive stage before its DiT stage (its
            requests go through the AR stage first and reach the runner with their payloads).
        padding_free: whether a mixed-size forward computes each row's real tokens only
            (length groups in eager forwards, `diffserve.pipelines.length_groups`): padding then
            costs memory but no compute, so the request scheduler's step cost model counts real
            tokens instead of token slots. (A forward whose padding is too small to pay for
            the extra block calls, `length_groups.worth_grouping`, runs padded: its padding
            costs less than those calls would, so it is still counted as free.)
    """

    spec: ModelSpec
    pipeline: str
    step_batching: bool = True
    chunk_streaming: bool = False
    quantization: dict | None = None
    ar_stage: bool = False
    padding_free: bool = False


@dataclass(frozen=True)
class MemoryProfile:
    """The loaded model's memory needs, measured once (see `diffserve.memory.profile`),
    for memory-aware admission. All sizes in bytes; pixels = height x width x frames.

    Attributes:
        weight_bytes: most bytes of weights the offload policy holds on the device.
        reserve_bytes: a denoiser forward's fixed part plus one prompt encode (paid once,
            whatever runs).
        row_bytes_base / row_bytes_per_pixel: bytes of one denoiser row (one image of one
            guidance branch) = base + per_pixel x pixels, fitted to the measurements.
        row_floor_base / row_floor_per_pixel: the same for the row's own denoiser inputs and
            output (exact; a row never counts less).
        decode_bytes_per_pixel: VAE decode peak per output pixel of one image.
        frames: frames the measurement used (1 for image models).
        points: the measured (height, width, bytes per row).
        method: how peaks were measured.
        device_available_bytes: what the device could give the engine when measured (CUDA:
            free + reserved by torch; CPU: MemAvailable + the process's RSS), None if unknown.
    """

    weight_bytes: int
    reserve_bytes: int
    row_bytes_base: float
    row_bytes_per_pixel: float
    decode_bytes_per_pixel: float
    row_floor_base: float = 0.0
    row_floor_per_pixel: float = 0.0
    frames: int = 1
    points: tuple[tuple[int, int, int], ...] = ()
    method: str = ""
    device_available_bytes: int | None = None

    def request_bytes(self, height: int, width: int, rows: int, images: int, frames: int | None = None) -> int:
        """Estimated bytes a request needs while it runs: its denoiser rows' activations,
        or its decode if larger (a request decodes after its last step)."""
        pixels = height * width * (frames or self.frames)
        per_row = max(self.row_bytes_base + self.row_bytes_per_pixel * pixels,
                      self.row_floor_base + self.row_floor_per_pixel * pixels, 0.0)
        return int(max(rows * per_row, images * self.decode_bytes_per_pixel * pixels))

    def token_bytes(self, height: int, width: int, rows: int, frames: int | None = None) -> int:
        """The part of `request_bytes`' row activations that grows with the rows' image
        tokens: rows x the steeper per-pixel slope (measured or floor) x pixels, rounded up.
        Divided by the request's image tokens it is the bytes of one token slot, what a row
        padded to a wider one in a mixed-size forward costs per slot of padding
        (`diffserve.engine.queues`); an upper bound, as ``max`` of two lines grows no faster
        than the steeper one."""
        pixels = height * width * (frames or self.frames)
        return int(math.ceil(rows * max(self.row_bytes_per_pixel, self.row_floor_per_pixel, 0.0) * pixels))


@dataclass(slots=True)
class SchedulerOutput:
    """What the workers run in one engine tick (the request scheduler's `schedule()`; vLLM's
    ``SchedulerOutput``). Empty fields are empty tuples, so an unchanged batch's tick costs no
    allocation beyond this object.

    The executor handles it in this order: free `finished_ids`; take the snapshots that
    `previews` and `decodes` read (before the step moves the latents on); queue the background
    work (previews, decodes, chunk boundaries, then the prepares of `new_requests`) beside the
    steps; run the denoising step of `step_ids`.

    Attributes:
        step_ids: the requests of this tick's denoising step (one batch key and step key), in
            batch order; empty when nothing steps. An unchanged batch passes the same list
            object every tick (the runner then reuses its per-step work).
        new_requests: requests admitted this tick, with their inputs: prepare them (encode the
            prompt, draw latents, create the diffusion scheduler).
        decodes: requests whose denoising finished: decode and free them.
        previews: requests at a preview step: decode their current latents (they keep running).
        chunks: streams whose chunk finished denoising: decode it and prepare the next one.
        finished_ids: requests that ended in the engine (aborted, or failed there) whose state
            the workers must drop.
        join_wait_s: > 0 on a tick that holds its step for `new_requests` (the request
            scheduler's join wait): wait up to this many seconds for their prepares.
    """

    step_ids: list[str] | tuple[()] = ()
    new_requests: list[NewRequest] | tuple[()] = ()
    decodes: list[str] | tuple[()] = ()
    previews: list[str] | tuple[()] = ()
    chunks: list[ChunkWork] | tuple[()] = ()
    finished_ids: list[str] | tuple[()] = ()
    join_wait_s: float = 0.0

    @property
    def has_work(self) -> bool:
        """Anything besides the step: frees, prepares, decodes, previews or chunk boundaries."""
        return bool(self.new_requests or self.decodes or self.previews or self.chunks or self.finished_ids)


@dataclass(slots=True)
class RunnerOutput:
    """What the workers report back for one `SchedulerOutput` (vLLM's ``ModelRunnerOutput``):
    the step's outcome and the background work that completed since the previous tick.

    Attributes:
        step: the denoising step's outcome (None when the output stepped nothing).
        step_start / step_end: `time.perf_counter()` seconds around the step (transport
            included), on the engine's clock; 0.0 without a step.
        prepared / decoded / chunks: results of prepare, decode (final or preview) and chunk
            boundary work that completed, in submission order.
        failed: background work items that raised as a whole (an executor fault, e.g. a dead
            worker): (their request ids, the error).
    """

    step: StepOutput | None = None
    step_start: float = 0.0
    step_end: float = 0.0
    prepared: list[Prepared] | tuple[()] = ()
    decoded: list[Decoded] | tuple[()] = ()
    chunks: list[ChunkDone] | tuple[()] = ()
    failed: list[tuple[list[str], WorkError]] | tuple[()] = ()

    @property
    def has_results(self) -> bool:
        """Any background work came back (or failed)."""
        return bool(self.prepared or self.decoded or self.chunks or self.failed)
