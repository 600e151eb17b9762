"""diffserve's built-in video model: a tiny Wan 2.1 text-to-video pipeline of moving digits.

``DEFAULT_MODEL_PATH`` is a standard diffusers ``WanPipeline`` folder, so
``WanPipeline.from_pretrained(DEFAULT_MODEL_PATH)`` loads it; its sampling defaults (size, frame
count, fps, steps, guidance) are in ``generation_config.json`` there. See ``MODEL_CARD.md`` next
to this file for how it was trained and how good it is, and ``training/digits_video/train.py`` in
the repository (not part of the package) to rebuild it.
"""

from pathlib import Path

from diffserve.models.digits_video.tokenizer import VOCABULARY_WORDS, out_of_vocabulary_words

#: Folder of the shipped pipeline (``model_index.json`` and one sub-folder per component).
DEFAULT_MODEL_PATH: Path = Path(__file__).resolve().parent / "weights"

__all__ = ["DEFAULT_MODEL_PATH", "VOCABULARY_WORDS", "out_of_vocabulary_words"]
