"""Text encoding shared by every family: one text at a time, through the prompt-embedding
cache, with absurdly long text cut before it reaches a tokenizer.

Each text (prompt or negative prompt) is encoded alone with one row, exactly as diffusers'
``encode_prompt`` encodes each list element (the negative prompt is a separate encoder forward
there too), and cached per text; a request repeats the rows for its images at use. So the
cache holds one entry per distinct text (the shared empty negative prompt is one entry for
everyone), and its size does not grow with ``num_images_per_prompt``.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from diffserve.pipelines.base import PipelineAdapter

#: No tokenizer diffserve serves maps more than this many characters to one token (CLIP BPE,
#: T5/UMT5 unigram and Qwen byte-level BPE pieces are all shorter; runs of whitespace aside), so
#: cutting text at ``limit * MAX_CHARS_PER_TOKEN`` characters keeps every token the encoder
#: would keep and spares tokenizing the rest (a 32,000-character prompt took ~1 s to tokenize).
MAX_CHARS_PER_TOKEN = 32


class TextEncoder:
    """Cached, length-safe text encoding for one adapter.

    Args:
        adapter: the owner (its ``prompt_embed_cache`` is looked up at every call, so the
            runner can install or remove the cache at any time).
        encode: ``encode(text, max_sequence_length, **encode_inputs) -> tuple of tensors`` with
            one row each (e.g. prompt_embeds (1, L, D), pooled (1, P)), the family's diffusers
            encoding (`encode_inputs` only when a caller passes them, e.g. an input image).
        tokenizers: ``(tokenizer, limit)`` pairs whose token limits truncate the text; a limit
            of None means the request's ``max_sequence_length``.
        key: everything besides the text and max_sequence_length that changes the encoding
            (e.g. a context-folding flag); the cache key also holds dtype and device.
    """

    def __init__(self, adapter: "PipelineAdapter", encode: Callable[[str, int | None], Sequence[Any]],
                 tokenizers: Sequence[tuple[Any, int | None]], key: Hashable = ()):
        self.adapter = adapter
        self._encode = encode
        self.tokenizers = [(t, limit) for t, limit in tokenizers if t is not None]
        self.key = key

    def cut(self, text: str, max_sequence_length: int | None = None) -> str:
        """`text` cut to the longest token budget x `MAX_CHARS_PER_TOKEN` characters."""
        limits = [limit if limit is not None else (max_sequence_length or 0) for _, limit in self.tokenizers]
        budget = max(limits, default=0) * MAX_CHARS_PER_TOKEN
        return text[:budget] if budget and len(text) > budget else text

    def is_truncated(self, text: str, max_sequence_length: int | None = None) -> bool:
        """Whether any tokenizer's ids for `text` exceed its limit (the encoder drops the
        rest). Tokenizers are not thread-safe: call from one thread at a time."""
        cut = self.cut(text, max_sequence_length)
        if len(cut) < len(text):
            return True
        for tokenizer, limit in self.tokenizers:
            limit = limit if limit is not None else max_sequence_length
            if limit is not None and len(tokenizer(cut).input_ids) > limit:
                return True
        return False

    def encode(self, text: str, max_sequence_length: int | None = None, *, extra_key: Hashable = (),
               **encode_inputs: Any) -> tuple[torch.Tensor, ...]:
        """The encoding of `text` (tensors with one row, the caller owns them).

        Args:
            extra_key: identifies `encode_inputs` in the cache key (e.g. a digest of an input
                image's pixels); required whenever `encode_inputs` are given.
            encode_inputs: further keyword arguments of the family's ``encode`` (e.g. the
                input image a vision-language encoder reads with the text).
        """
        if encode_inputs and extra_key == ():
            raise ValueError("encode inputs need an extra_key that identifies them in the cache")
        text = self.cut(text, max_sequence_length)
        cache = self.adapter.prompt_embed_cache

        def run() -> tuple[torch.Tensor, ...]:
            return tuple(self._encode(text, max_sequence_length, **encode_inputs))

        if cache is None:
            return run()
        key = (type(self.adapter).__name__, text, max_sequence_length, self.key, extra_key,
               str(self.adapter.dtype), str(self.adapter.device))
        return cache.get_or_encode(key, run)


def repeat_rows(tensor: Any, n: int) -> Any:
    """A one-row tensor repeated to `n` rows (dim 0); None and n == 1 unchanged."""
    if tensor is None or n == 1:
        return tensor
    return tensor.repeat(n, *([1] * (tensor.dim() - 1)))
