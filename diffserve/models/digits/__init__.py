"""diffserve's built-in default model: a tiny text-to-image SD3 pipeline for 8x8 digits.

``DEFAULT_MODEL_PATH`` is a standard diffusers ``StableDiffusion3Pipeline`` folder (no T5), so
``StableDiffusion3Pipeline.from_pretrained(DEFAULT_MODEL_PATH)`` loads it. See ``MODEL_CARD.md``
next to this file for how it was trained and how good it is, and ``training/digits/train.py`` in
the repository (not part of the package) to rebuild it.
"""

from pathlib import Path

from diffserve.models.digits.tokenizer import VOCABULARY_WORDS, out_of_vocabulary_words

#: Folder of the shipped pipeline (``model_index.json`` and one sub-folder per component).
DEFAULT_MODEL_PATH: Path = Path(__file__).resolve().parent / "weights"

__all__ = ["DEFAULT_MODEL_PATH", "VOCABULARY_WORDS", "out_of_vocabulary_words"]
