"""Memory-aware admission: the memory side of the request scheduler's budget.

With ``EngineConfig.max_memory`` set, the engine asks the executor for the model's
`MemoryProfile` (measured once at startup, `diffserve.memory.profile`) and splits the
limit into:

    max_memory = weights on the device (at the offload policy's peak)
               + reserve (a denoiser forward's fixed part + one prompt encode)
               + available  (what running requests may use)

Each request costs `MemoryProfile.request_bytes` (its denoiser rows' activations at its
resolution, or its VAE decode if larger), of which `MemoryProfile.token_bytes` grows with its
image tokens: per token slot, what a row padded to a wider one costs more in a mixed-size
forward (the step batch counts that padding within the same limit, `diffserve.engine.queues`). The request scheduler admits a waiting request only
while the running requests' costs plus its own stay within ``available`` (FIFO: a request
that does not fit yet waits, and nobody overtakes it); a request whose cost alone exceeds
``available`` can never run and is refused when added (`InvalidRequestError`, HTTP 400) naming
the limit, instead of failing later with an out-of-memory error.
"""

from __future__ import annotations

from typing import Any

from diffserve.core.errors import InvalidRequestError
from diffserve.core.memory_size import format_bytes, parse_memory
from diffserve.core.messages import MemoryProfile
from diffserve.core.sampling_params import SamplingParams


class MemoryBudget:
    """The bytes running requests may use, and each request's cost.

    Args:
        limit: ``max_memory`` in bytes.
        profile: the model's measured `MemoryProfile`.

    Attributes:
        available: bytes left for requests after the weights and the reserve.
    """

    def __init__(self, limit: int, profile: MemoryProfile):
        self.limit = limit
        self.profile = profile
        self.available = limit - profile.weight_bytes - profile.reserve_bytes

    @classmethod
    def from_config(cls, max_memory: Any, profile: MemoryProfile | None) -> "MemoryBudget":
        """Build the budget of ``EngineConfig.max_memory``.

        Raises:
            InvalidRequestError: ``max_memory`` is malformed, ``"auto"`` where the device's
                free memory is unknown, no profile exists (the model runs whole requests),
                or the limit does not even hold the weights and the reserve.
        """
        limit = parse_memory(max_memory)
        if profile is None:
            raise InvalidRequestError("max_memory", max_memory, "None: this model runs whole requests through its "
                                      "own pipeline call, whose memory diffserve cannot budget")
        if limit == "auto":
            if profile.device_available_bytes is None:
                raise InvalidRequestError("max_memory", max_memory, "a size: the device's free memory is unknown here")
            limit = profile.device_available_bytes
        budget = cls(int(limit), profile)
        if budget.available <= 0:
            need = profile.weight_bytes + profile.reserve_bytes
            raise InvalidRequestError(
                "max_memory", max_memory,
                f"more than {need} bytes ({format_bytes(need)}): the weights on the device "
                f"({format_bytes(profile.weight_bytes)}) plus a forward's fixed part and a prompt encode "
                f"({format_bytes(profile.reserve_bytes)}), measured by {profile.method}")
        return budget

    def request_bytes(self, params: SamplingParams, rows: int) -> int:
        """Estimated bytes of a request with resolved `params` and `rows` denoiser rows."""
        return self.profile.request_bytes(params.height, params.width, rows, params.num_images_per_prompt,
                                          params.num_frames)

    def token_bytes(self, params: SamplingParams, rows: int) -> int:
        """The part of `request_bytes` proportional to the request's image tokens
        (`MemoryProfile.token_bytes`): per token slot, what padding its rows costs."""
        return self.profile.token_bytes(params.height, params.width, rows, params.num_frames)

    def check(self, params: SamplingParams, rows: int) -> int:
        """The request's cost in bytes, if it can ever run.

        Raises:
            InvalidRequestError: it alone needs more than `available` (field
                ``num_images_per_prompt`` when fewer images would fit, else ``size``), naming
                ``max_memory``.
        """
        cost = self.request_bytes(params, rows)
        if cost <= self.available:
            return cost
        images = params.num_images_per_prompt
        per_image = cost / max(images, 1)
        why = (f"within max_memory={self.limit} bytes ({format_bytes(self.limit)}): it needs ~{format_bytes(cost)} "
               f"while {format_bytes(self.available)} remain beside the weights "
               f"({format_bytes(self.profile.weight_bytes)}) and the reserve "
               f"({format_bytes(self.profile.reserve_bytes)})")
        if images > 1 and per_image <= self.available:
            fit = int(self.available // per_image)
            raise InvalidRequestError("num_images_per_prompt", images, f"at most {fit} at this size to fit {why}")
        raise InvalidRequestError("size", f"{params.width}x{params.height}", f"a smaller size to fit {why}")

    def stats(self, in_use: int, padding: int = 0) -> dict[str, Any]:
        """``max_memory``, ``weight_bytes``, ``reserve_bytes``, ``available``, ``in_use``
        (estimated bytes of the running requests) and ``padding_bytes`` (what padding the rows
        of the last step batch to its widest adds, `RequestQueues.padding_bytes`), all bytes,
        plus the profile's ``method``."""
        return {"max_memory": self.limit, "weight_bytes": self.profile.weight_bytes,
                "reserve_bytes": self.profile.reserve_bytes, "available": self.available, "in_use": in_use,
                "padding_bytes": padding, "method": self.profile.method}
