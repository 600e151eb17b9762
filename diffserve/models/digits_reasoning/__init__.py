"""The built-in ``digits-reasoning`` model: a causal LM (AR stage) that answers arithmetic
prompts and a DiT that draws the answer by reading the LM's per-layer K/V. ``weights`` is a
`DigitsReasoningPipeline` folder; see ``MODEL_CARD.md`` and ``training/digits_reasoning``."""

from pathlib import Path

#: Folder of the shipped pipeline.
MODEL_PATH: Path = Path(__file__).resolve().parent / "weights"

__all__ = ["MODEL_PATH"]
