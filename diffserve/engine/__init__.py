"""Request lifecycle: the engines and the request scheduler."""

from diffserve.engine.engine import DiffusionEngine

__all__ = ["DiffusionEngine"]
