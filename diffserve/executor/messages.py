"""Plain data crossing the executor boundary (engine <-> workers).

The engine never touches tensors or the runner's per-request state: it hands workers
`NewRequest` s to prepare, request ids to step or decode, and ids to free; workers answer with
`Prepared`, `StepOutput` and `Decoded`. Everything here is picklable (tensors inside
`NewRequest.inputs` and `Decoded.output` are CPU tensors / arrays / PIL images), so a worker can
live in another process (like vLLM's ``SchedulerOutput`` / ``ModelRunnerOutput``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from diffserve.sampling_params import ModelSpec, SamplingParams


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
        inputs: `diffserve.pipelines.base.RequestInputs` (input images / mask) or None.
    """

    request_id: str
    prompt: str
    params: SamplingParams
    inputs: Any = None


@dataclass
class Prepared:
    """Outcome of preparing one request.

    Attributes:
        num_steps: denoising steps it will run (its timesteps).
        seconds: wall-clock seconds of the encode + latent preparation.
        error: set when preparing failed (the request is gone from the worker).
        step_key: the adapter's step key for its first step (`PipelineAdapter.step_key`).
    """

    request_id: str
    num_steps: int = 0
    prompt_truncated: bool = False
    negative_prompt_truncated: bool = False
    seconds: float = 0.0
    error: WorkError | None = None
    step_key: Any = None


@dataclass
class StepOutput:
    """Outcome of one denoising step over a batch.

    Attributes:
        num_rows: denoiser rows in the forward (all requests, guidance branches included); the
            largest forward's when requests had to run alone.
        steps_done: request_id -> denoising steps done after this step (requests that stepped).
        errors: request_id -> failure (those requests are gone from the worker).
        num_steps: request_id -> its total denoising steps, when the worker learned it only
            while running (whole-request pipelines: img2img strength shortens the schedule).
        seconds: wall-clock seconds of the step.
        step_keys: request_id -> the adapter's step key for its next step (requests that
            stepped; `PipelineAdapter.step_key`).
    """

    num_rows: int = 0
    steps_done: dict[str, int] = field(default_factory=dict)
    num_steps: dict[str, int] = field(default_factory=dict)
    errors: dict[str, WorkError] = field(default_factory=dict)
    seconds: float = 0.0
    step_keys: dict[str, Any] = field(default_factory=dict)


@dataclass
class Decoded:
    """A decoded request (final output or preview).

    Attributes:
        output: media of the request's output_type (images, or video frames), None on error.
        step: denoising steps done when the latents were taken (previews).
        preview: True for a preview (the request keeps running).
        seconds: wall-clock seconds of the decode.
    """

    request_id: str
    output: Any = None
    step: int = 0
    preview: bool = False
    seconds: float = 0.0
    error: WorkError | None = None


@dataclass(frozen=True)
class RequestPlan:
    """What the request scheduler needs to know about a request: its denoiser rows per step
    and its batch key (requests with equal keys may share a forward)."""

    rows: int
    batch_key: Any


@dataclass(frozen=True)
class ModelInfo:
    """The loaded model as the engine sees it.

    Attributes:
        spec: defaults and limits for validation.
        pipeline: the diffusers pipeline class name.
        step_batching: whether requests run step by step (False: whole-request fallback).
    """

    spec: ModelSpec
    pipeline: str
    step_batching: bool = True
