"""Offline CLIP tokenizers for the built-in digits model.

The vocabulary is CLIP's byte-level BPE scheme (Radford et al. 2021, "Learning Transferable
Visual Models From Natural Language Supervision"; the same layout as ``openai/clip-vit-*``'s
``vocab.json``/``merges.txt``) shrunk to:

* the 256 byte-level symbols, and the same 256 with the end-of-word marker ``</w>``, so every
  string -- commas, emoji, words never seen -- tokenizes into known symbols and never into the
  unknown token (which CLIP maps to ``<|endoftext|>``, where the pooled embedding is read);
* whole-word tokens for :data:`VOCABULARY_WORDS`, built by chaining BPE merges left to right
  (``h a`` -> ``ha``, ``ha n`` -> ``han``, ...);
* ``<|startoftext|>`` (BOS) and ``<|endoftext|>`` (EOS, also used as pad and unk).

Nothing is downloaded: the tokenizer is built from an in-memory vocab and merge list.
"""

from __future__ import annotations

import re

from tokenizers.pre_tokenizers import ByteLevel
from transformers import CLIPTokenizer

#: Maximum tokens per prompt including BOS and EOS; longer prompts are truncated.
MODEL_MAX_LENGTH = 16

BOS_TOKEN = "<|startoftext|>"
EOS_TOKEN = "<|endoftext|>"

#: Words that tokenize to a single whole-word token. Digits 0-9 are single tokens anyway
#: (CLIP's pre-tokenizer splits every digit on its own) and are listed for completeness.
VOCABULARY_WORDS: tuple[str, ...] = (
    # digits and number words
    "0", "1", "2", "3", "4", "5", "6", "7", "8", "9",
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
    # prompt words
    "a", "an", "the", "of", "handwritten", "digit", "number", "numeral", "drawing",
    "image", "picture", "photo", "written", "hand", "sketch", "small", "black", "white",
    "and", "on", "single", "show", "me", "draw",
)


def _word_merges(words: tuple[str, ...]) -> list[tuple[str, str]]:
    """Left-to-right BPE merge chains that turn each multi-letter word into one token.

    Returns:
        Merge pairs in rank order (earliest first), without duplicates. For ``"an"`` this is
        ``[("a", "n</w>")]``; for ``"the"`` ``[("t", "h"), ("th", "e</w>")]``.
    """
    merges: list[tuple[str, str]] = []
    seen: set[tuple[str, str]] = set()
    for word in words:
        if len(word) < 2:
            continue
        prefix = word[0]
        for i, char in enumerate(word[1:], start=1):
            piece = char + "</w>" if i == len(word) - 1 else char
            pair = (prefix, piece)
            if pair not in seen:
                seen.add(pair)
                merges.append(pair)
            prefix = prefix + char
    return merges


def build_clip_tokenizer(model_max_length: int = MODEL_MAX_LENGTH) -> CLIPTokenizer:
    """Build the digits model's CLIP tokenizer in memory (no files, no downloads).

    Args:
        model_max_length: prompts are padded/truncated to this many token ids (BOS and EOS
            included) by the SD3 pipeline.

    Returns:
        A ``transformers.CLIPTokenizer`` with ``pad_token == unk_token == eos_token ==
        "<|endoftext|>"``. Every string maps to known tokens (byte-level fallback).

    Raises:
        RuntimeError: if a word of :data:`VOCABULARY_WORDS` does not come out as one token
            (a merge-order conflict between words; should not happen for the shipped list).
    """
    byte_symbols = sorted(ByteLevel.alphabet())  # the 256 byte-level symbols, fixed order
    tokens = [BOS_TOKEN, EOS_TOKEN] + byte_symbols + [s + "</w>" for s in byte_symbols]
    merges = _word_merges(VOCABULARY_WORDS)
    for left, right in merges:
        tokens.append(left + right)
    vocab: dict[str, int] = {}
    for token in tokens:
        vocab.setdefault(token, len(vocab))
    tokenizer = CLIPTokenizer(
        vocab=vocab,
        merges=merges,
        model_max_length=model_max_length,
    )
    for word in VOCABULARY_WORDS:
        ids = tokenizer(word, add_special_tokens=False).input_ids
        if len(ids) != 1:
            raise RuntimeError(f"vocabulary word {word!r} tokenizes to {len(ids)} tokens: {ids}")
    return tokenizer


_WORD_RE = re.compile(r"[^\W_]+")
_VOCABULARY_SET = frozenset(VOCABULARY_WORDS)


def out_of_vocabulary_words(prompt: str) -> list[str]:
    """Words of ``prompt`` that are not whole-word tokens of the digits tokenizer.

    The prompt is lower-cased and split on anything that is not a letter or digit
    (punctuation is dropped). Multi-digit numbers are split into single digits, as CLIP's
    pre-tokenizer does, so ``"42"`` is in vocabulary. Such words still tokenize (into
    byte-level pieces), but the model never saw them, so a caller may want to warn.

    Args:
        prompt: any text.

    Returns:
        The out-of-vocabulary words in order of appearance, duplicates kept; ``[]`` when
        every word is known.
    """
    words: list[str] = []
    for word in _WORD_RE.findall(prompt.lower()):
        if word.isdigit():
            continue
        # split letter runs from digit runs ("digit3" -> "digit", "3"), like CLIP's regex
        words.extend(part for part in re.findall(r"[^\W\d_]+", word) if part not in _VOCABULARY_SET)
    return words
