"""Request lifecycle: the engines and the request scheduler."""

from diffserve.engine.async_engine import AsyncDiffusionEngine
from diffserve.engine.engine import DiffusionEngine

__all__ = ["AsyncDiffusionEngine", "DiffusionEngine"]
