"""diffserve: a serving engine for diffusion models.

Public API: `DiffusionEngine` (offline), `AsyncDiffusionEngine` (streaming), `EngineConfig`,
`SamplingParams`, `GenerationOutput`, `StreamEvent` and the error types.
"""

from diffserve.config import EngineConfig
from diffserve.engine.async_engine import AsyncDiffusionEngine
from diffserve.engine.engine import DiffusionEngine
from diffserve.errors import (
    EngineOverloadedError,
    InvalidRequestError,
    RequestFailedError,
    UnsupportedModelError,
)
from diffserve.outputs import EventType, GenerationOutput, RequestMetrics, RequestStatus, StreamEvent
from diffserve.sampling_params import SamplingParams

__all__ = [
    "DiffusionEngine",
    "AsyncDiffusionEngine",
    "EngineConfig",
    "SamplingParams",
    "GenerationOutput",
    "RequestMetrics",
    "RequestStatus",
    "StreamEvent",
    "EventType",
    "InvalidRequestError",
    "EngineOverloadedError",
    "UnsupportedModelError",
    "RequestFailedError",
]
__version__ = "0.1.0"
