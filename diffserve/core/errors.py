"""Error types raised by diffserve.

Every error a user can cause is an `InvalidRequestError` (a `ValueError`) that names the field,
the offending value and the allowed range; the HTTP server maps it to a 400 in OpenAI's format.
"""

from __future__ import annotations

from typing import Any


class InvalidRequestError(ValueError):
    """A request field is invalid.

    Attributes:
        field: name of the offending field (e.g. ``"num_inference_steps"``).
        value: the value received.
        allowed: human-readable allowed range (e.g. ``"an integer in [1, 200]"``).
    """

    def __init__(self, field: str, value: Any, allowed: str, detail: str | None = None):
        self.field = field
        self.value = value
        self.allowed = allowed
        shown = repr(value)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        message = f"invalid {field}={shown}: must be {allowed}"
        if detail:
            message += f" ({detail})"
        self.detail = detail
        super().__init__(message)

    def __reduce__(self):
        """Pickle by fields (errors cross process boundaries: the multi-process executor);
        a value that is not plain data travels as its repr."""
        value = self.value if isinstance(self.value, (str, int, float, bool, type(None))) else repr(self.value)
        return (type(self), (self.field, value, self.allowed, self.detail))


class EngineOverloadedError(RuntimeError):
    """The engine's waiting queue is full; retry later (HTTP 429)."""


class DeadlineUnmeetableError(EngineOverloadedError):
    """``--admission slo``: the request's ``deadline_s`` cannot be met at the current load
    (the step cost model's prediction exceeds it); refused at arrival (HTTP 429, code
    ``deadline_unmeetable``). `reason` says by how much."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class UnsupportedModelError(ValueError):
    """The model folder holds a pipeline class diffserve has no adapter for, or is not a
    diffusers folder at all."""


class RequestFailedError(RuntimeError):
    """A request failed while running (its own error; other requests are unaffected)."""


class NonFiniteOutputError(RuntimeError):
    """A request's latents or decoded pixels hold NaN/inf (e.g. fp16 overflow); the request
    fails (HTTP 500 ``server_error``) instead of returning a black image."""


class EngineSleepingError(RuntimeError):
    """The engine is asleep (or going to sleep) and admits no requests until `wake_up`
    (HTTP 503 with ``Retry-After``)."""


class EngineDeadError(RuntimeError):
    """The engine loop (or a worker) died; requests fail fast (HTTP 503) instead of waiting."""


class UnknownLoraError(InvalidRequestError):
    """A request names a LoRA adapter the engine does not hold (field ``loras``). The HTTP
    server answers it with 404 ``lora_not_found``, as vLLM answers an unknown model or LoRA
    name: the request is well formed, the resource is missing."""


class LoraInUseError(RuntimeError):
    """A LoRA adapter that waiting or running requests use cannot be unloaded or replaced now
    (HTTP 409); the message says which and why."""


class InteractionRefusedError(InvalidRequestError):
    """An interaction (`DiffusionEngine.submit_interaction`) that cannot apply to its request.

    Attributes:
        reason: ``"unknown_request"`` (no such id), ``"finished"`` (the request ended or is
            being aborted), ``"last_chunk"`` (no later chunk is left to use it),
            ``"not_streaming"`` (an ordinary request, without ``num_chunks``) or
            ``"unsupported"`` (the served model cannot stream chunks).
    """

    def __init__(self, request_id: str, reason: str, allowed: str, detail: str | None = None):
        self.reason = reason
        super().__init__("request_id", request_id, allowed, detail)

    def __reduce__(self):
        return (type(self), (self.value, self.reason, self.allowed, self.detail))
