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
    "SamplingParams": "diffserve.core.sampling_params",
    "GenerationOutput": "diffserve.core.outputs",
    "RequestMetrics": "diffserve.core.outputs",
    "RequestStatus": "diffserve.core.outputs",
    "StreamEvent": "diffserve.core.outputs",
    "EventType": "diffserve.core.outputs",
    "InvalidRequestError": "diffserve.core.errors",
    "EngineOverloadedError": "diffserve.core.errors",
    "UnsupportedModelError": "diffserve.core.errors",
    "RequestFailedError": "diffserve.core.errors",
    "EngineDeadError": "diffserve.core.errors",
    "EngineSleepingError": "diffserve.core.errors",
    "NonFiniteOutputError": "diffserve.core.errors",
    "LoraInUseError": "diffserve.core.errors",
    "RequestInputs": "diffserve.core.inputs",
}
__all__ = list(_EXPORTS)

if TYPE_CHECKING:
    from diffserve.config import EngineConfig
    from diffserve.engine.async_engine import AsyncDiffusionEngine
    from diffserve.engine.engine import DiffusionEngine
    from diffserve.core.errors import (
        EngineDeadError,
        EngineOverloadedError,
        EngineSleepingError,
        NonFiniteOutputError,
        InvalidRequestError,
        LoraInUseError,
        RequestFailedError,
        UnsupportedModelError,
    )
    from diffserve.core.outputs import EventType, GenerationOutput, RequestMetrics, RequestStatus, StreamEvent
    from diffserve.core.inputs import RequestInputs
    from diffserve.core.sampling_params import SamplingParams


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'diffserve' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
