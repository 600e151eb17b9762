"""`CacheBackend`: the interface of the step-caching backends (none, teacache, cache_dit).

A backend is installed once when the model loads, resets its per-request state at the start
of every request (with that request's own step count), and runs the denoiser forward of a
step batch. All caching state lives in each request's ``RequestState.extra`` (never in the
model), so requests never see each other's state and a request's output does not depend on
what ran before it or beside it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch

from diffserve.core.errors import InvalidRequestError

if TYPE_CHECKING:
    from diffserve.core.sampling_params import SamplingParams
    from diffserve.pipelines.base import PipelineAdapter, RequestState
    from diffserve.pipelines.step_batch import StepBatch


class CacheBackend:
    """No caching: every step runs the full denoiser (the ``none`` backend and the base class).

    Attributes:
        name: the ``EngineConfig.cache_backend`` value that selects this backend.
        shares_forward: whether several requests may share one denoiser forward. False means
            the runner gives this backend one request per forward.
        transformer_calls: request-steps run so far (one per request per denoising step).
        skipped: request-steps whose transformer blocks were skipped (cached result reused).
    """

    name: ClassVar[str] = "none"
    shares_forward: ClassVar[bool] = True

    def __init__(self) -> None:
        self.transformer_calls = 0
        self.skipped = 0

    def reset(self, state: "RequestState") -> None:
        """Start a request's caching state from scratch (called after `prepare`, so
        ``state.num_steps`` and the latent size are known)."""

    def check_params(self, params: "SamplingParams") -> None:
        """Refuse a request's ``cache_quality`` this backend cannot honour: without step
        caching only ``"max"`` (no skipping) or unset.

        Raises:
            InvalidRequestError: (field ``cache_quality``) naming what this engine accepts.
        """
        if params.cache_quality not in (None, "max"):
            raise InvalidRequestError("cache_quality", params.cache_quality,
                                      f"unset or max: this engine runs with cache_backend={self.name} "
                                      "(quality levels need --cache-backend teacache)")

    def request_summary(self, state: "RequestState") -> dict[str, Any] | None:
        """What a finished request's metrics report of its caching: ``cache_quality`` (its
        level), ``skipped_steps``, ``error_estimate`` (the guard's estimate of the relative
        error skipping added) and ``check_steps``; None when the backend keeps no per-request
        record."""
        return None

    def save(self, states: list["RequestState"]) -> Any:
        """What `restore` needs to put the requests' caching state (and the counters) back as
        it is now: taken before a shared step, so that if the step fails after the forward and
        each request is retried alone, no request's state advances twice. None: no state."""
        return None

    def restore(self, states: list["RequestState"], saved: Any) -> None:
        """Put back what `save` returned for the same `states`."""

    def denoise(self, adapter: "PipelineAdapter", batch: "StepBatch") -> torch.Tensor:
        """One denoising forward for `batch` (``adapter.denoise``); returns the (rows, ...)
        predictions."""
        out = adapter.denoise(batch)
        self.transformer_calls += len(batch.states)
        return out

    def stats(self) -> dict[str, Any]:
        """``name``, ``transformer_calls``, ``skipped`` and ``skip_fraction`` (skipped /
        calls, 0 when none), counted in request-steps since load."""
        calls = self.transformer_calls
        return {
            "name": self.name,
            "transformer_calls": calls,
            "skipped": self.skipped,
            "skip_fraction": self.skipped / calls if calls else 0.0,
        }
