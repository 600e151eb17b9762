"""Offline UMT5-style tokenizer for the built-in video model (Wan pipelines use a T5 tokenizer).

The image model's tokenizer (:mod:`diffserve.models.digits.tokenizer`) is CLIP byte-level BPE with
whole-word tokens for its prompt words; this one follows the same idea in the T5 / UMT5 format
(a SentencePiece-style Unigram model, Kudo 2018, arXiv:1804.10959, as in ``google/umt5-xxl``),
built from an in-memory vocabulary, so nothing is downloaded:

* ``<pad>`` (id 0), ``</s>`` (EOS, id 1, appended to every prompt), ``<unk>`` (id 2), ``▁``;
* every ASCII letter, digit and common punctuation mark, alone and word-initial
  (``a`` / ``▁a``), so any such text tokenizes without the unknown token;
* one whole-word piece (``▁moving``) for each of :data:`VOCABULARY_WORDS`: the image model's
  words (:data:`diffserve.models.digits.tokenizer.VOCABULARY_WORDS`) plus the motion words
  :data:`MOTION_WORDS`. Whole words score far above their
  spelling, so the Unigram model picks them.

Unlike CLIP's tokenizer it does not lower-case (``T5Tokenizer`` rebuilds its normalizer when
loaded, so a lower-casing step would not survive ``from_pretrained``): ``"Moving"`` is spelled
out letter by letter and is not the trained word ``moving``. Characters outside the list
(accents, emoji) become ``<unk>``.
"""

from __future__ import annotations

import re

from transformers import T5Tokenizer

from diffserve.models.digits.tokenizer import VOCABULARY_WORDS as IMAGE_VOCABULARY_WORDS

#: Words of the motion phrases in the training captions (``training/digits_video/data.py``,
#: outside the package); each gets a whole-word piece.
MOTION_WORDS: tuple[str, ...] = (
    "moving", "moves", "going", "sliding", "that", "to", "left", "right", "up", "down",
)

#: Words that tokenize to one whole-word piece.
VOCABULARY_WORDS: tuple[str, ...] = IMAGE_VOCABULARY_WORDS + tuple(
    w for w in MOTION_WORDS if w not in IMAGE_VOCABULARY_WORDS
)
#: Single characters in the vocabulary (each also with the word-start marker ``▁``).
CHARACTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'-:;()\"/&+"

#: Log-probabilities of the Unigram pieces: a whole word beats any spelling of it.
_WORD_SCORE = -1.0
_CHAR_SCORE = -4.0
_SPACE_SCORE = -2.0


def build_umt5_tokenizer() -> T5Tokenizer:
    """Build the video model's tokenizer in memory (no files, no downloads).

    Returns:
        A ``transformers.T5Tokenizer`` (pad id 0, EOS id 1, unk id 2, no sentinel tokens). ``WanPipeline`` pads its output to ``max_sequence_length``.

    Raises:
        RuntimeError: if a word of :data:`VOCABULARY_WORDS` does not come out as one piece.
    """
    pieces: dict[str, float] = {"<pad>": 0.0, "</s>": 0.0, "<unk>": 0.0, "▁": _SPACE_SCORE}
    for char in CHARACTERS:
        pieces.setdefault(char, _CHAR_SCORE)
        pieces.setdefault("▁" + char, _CHAR_SCORE)
    for word in VOCABULARY_WORDS:
        pieces["▁" + word] = _WORD_SCORE
    tokenizer = T5Tokenizer(vocab=list(pieces.items()), extra_ids=0)
    for word in VOCABULARY_WORDS:
        ids = tokenizer(word, add_special_tokens=False).input_ids
        if len(ids) != 1:
            raise RuntimeError(f"vocabulary word {word!r} tokenizes to {len(ids)} pieces: {ids}")
    return tokenizer


_VOCABULARY_SET = frozenset(VOCABULARY_WORDS)


def out_of_vocabulary_words(prompt: str) -> list[str]:
    """Words of ``prompt`` that are not whole-word pieces of the video tokenizer.

    Words are runs of letters (numbers are always known: digits are single pieces). Unlike the
    image model's :func:`diffserve.models.digits.out_of_vocabulary_words` the check is
    case-sensitive, as the tokenizer is: ``"Moving"`` is reported. Such words still tokenize
    (spelled out), but the model never saw them, so a caller may want to warn.

    Returns:
        The unknown words in order of appearance, duplicates kept; ``[]`` when all are known.
    """
    return [w for w in re.findall(r"[^\W\d_]+", prompt) if w not in _VOCABULARY_SET]
