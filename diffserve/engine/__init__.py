"""Requests from arrival to their final event: the engine client (`client.py`, the one module
the entrypoints import), the two engines, the input processor and the request scheduler."""

from diffserve.engine.async_engine import AsyncDiffusionEngine
from diffserve.engine.engine import DiffusionEngine

__all__ = ["AsyncDiffusionEngine", "DiffusionEngine"]
