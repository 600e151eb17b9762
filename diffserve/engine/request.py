"""`Request`: one generation request as the engine tracks it through its lifecycle."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

from diffserve.outputs import RequestMetrics, RequestStatus
from diffserve.pipelines.base import RequestState
from diffserve.sampling_params import SamplingParams


@dataclass
class Request:
    """A request inside the engine.

    Attributes:
        params: resolved (validated, defaults filled) sampling params.
        batch_key: the adapter's key; requests with equal keys can share a denoising step.
        rows: transformer rows per step (num_images x 2 with CFG).
        seq: arrival sequence number (the request scheduler's age order).
        state: the runner's per-request tensors; None until admitted.
        preview_steps: steps after which a decoded preview is streamed (partial events).
    """

    request_id: str
    prompt: str
    params: SamplingParams
    batch_key: Hashable
    rows: int
    seq: int
    arrival_time: float
    prompt_truncated: bool = False
    status: RequestStatus = RequestStatus.WAITING
    state: RequestState | None = None
    abort_requested: bool = False
    first_step_time: float | None = None
    preview_steps: frozenset[int] = frozenset()
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
