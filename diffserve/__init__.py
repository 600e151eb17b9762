"""diffserve: a serving engine for diffusion models.

Public API: `DiffusionEngine` (offline), `AsyncDiffusionEngine` (streaming), `EngineConfig`,
`SamplingParams`, `GenerationOutput`, `StreamEvent` and the error types. Names are imported on
first use (PEP 562), so ``import diffserve`` and the CLI's ``--help`` stay fast.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

_EXPORTS = {
    "DiffusionEngine": "diffserve.engine.engine",
    "AsyncDiffusionEngine": "diffserve.engine.async_engine",
    "EngineConfig": "diffserve.config",
    "SamplingParams": "diffserve.sampling_params",
    "GenerationOutput": "diffserve.outputs",
    "RequestMetrics": "diffserve.outputs",
    "RequestStatus": "diffserve.outputs",
    "StreamEvent": "diffserve.outputs",
    "EventType": "diffserve.outputs",
    "InvalidRequestError": "diffserve.errors",
    "EngineOverloadedError": "diffserve.errors",
    "UnsupportedModelError": "diffserve.errors",
    "RequestFailedError": "diffserve.errors",
    "EngineDeadError": "diffserve.errors",
    "EngineSleepingError": "diffserve.errors",
    "NonFiniteOutputError": "diffserve.errors",
    "RequestInputs": "diffserve.pipelines.base",
}
__all__ = list(_EXPORTS)

if TYPE_CHECKING:
    from diffserve.config import EngineConfig
    from diffserve.engine.async_engine import AsyncDiffusionEngine
    from diffserve.engine.engine import DiffusionEngine
    from diffserve.errors import (
        EngineDeadError,
        EngineOverloadedError,
        EngineSleepingError,
        NonFiniteOutputError,
        InvalidRequestError,
        RequestFailedError,
        UnsupportedModelError,
    )
    from diffserve.outputs import EventType, GenerationOutput, RequestMetrics, RequestStatus, StreamEvent
    from diffserve.pipelines.base import RequestInputs
    from diffserve.sampling_params import SamplingParams


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'diffserve' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
