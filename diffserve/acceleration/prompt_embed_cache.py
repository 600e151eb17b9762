"""`PromptEmbedCache`: an LRU of text-encoder outputs, so a repeated prompt skips encoding.

Serving traffic repeats prompts (retries, several seeds of one prompt, the empty negative
prompt); the text encoders (CLIP x2, plus T5-XXL on real SD3) then recompute the same
embeddings. The cache maps every argument that changes the encoding to the encoder's output
tensors. It is bounded both in entries and in bytes of tensor storage (an entry holds one row
per text, see `diffserve.pipelines.text_encoding`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch


class PromptEmbedCache:
    """Least-recently-used cache of prompt encodings.

    Keys are ``(model, *key)``: the model identity given at construction followed by the
    adapter's key, which must hold every encode argument that changes the result (prompt,
    negative prompt, images per prompt, CFG on/off, max sequence length, dtype, device).
    Values are tuples of tensors (e.g. ``prompt_embeds`` (rows, L, D) and
    ``pooled_prompt_embeds`` (rows, P) in the model dtype, on the model device).

    A stored entry is a private copy: `get_or_encode` stores a clone of a fresh encoding and
    returns a clone on every hit, so a request that writes into its tensors in place can never
    change what a later request receives. Thread-safe.

    Args:
        capacity: most entries kept (>= 1); the least recently used one is evicted first.
        model: identity of the model whose encoders produce the values (e.g. its folder).
        max_bytes: most bytes of tensor storage kept (>= 1; None = no byte bound); least
            recently used entries are evicted until the total fits, and an entry larger than
            the bound alone is not stored.

    Raises:
        ValueError: capacity < 1 or max_bytes < 1.
    """

    def __init__(self, capacity: int, model: str = "", max_bytes: int | None = None):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if max_bytes is not None and max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1 or None, got {max_bytes}")
        self.capacity = capacity
        self.max_bytes = max_bytes
        self.model = model
        self._entries: OrderedDict[Hashable, tuple[torch.Tensor | None, ...]] = OrderedDict()
        self._sizes: dict[Hashable, int] = {}
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Sequence[Hashable]) -> bool:
        """Whether `key` (as given to `get_or_encode`) is cached; counts as neither hit nor miss."""
        with self._lock:
            return (self.model, *key) in self._entries

    def get_or_encode(
        self, key: Sequence[Hashable], encode: Callable[[], tuple[torch.Tensor, ...]]
    ) -> tuple[torch.Tensor, ...]:
        """Return the cached encoding for `key`, or call `encode()` and cache its result.

        Args:
            key: the encode arguments (hashable); the model identity is prepended.
            encode: computes the tensors on a miss (called without the lock held).

        Returns:
            A tuple of fresh tensors equal to ``encode()``'s (clones; the caller owns them).
        """
        full_key = (self.model, *key)
        with self._lock:
            cached = self._entries.get(full_key)
            if cached is not None:
                self._entries.move_to_end(full_key)
                self.hits += 1
                return tuple(None if t is None else t.clone() for t in cached)
            self.misses += 1
        value = tuple(encode())
        stored = tuple(None if t is None else t.detach().clone() for t in value)
        size = _nbytes(stored)
        if self.max_bytes is not None and size > self.max_bytes:
            return value
        with self._lock:
            if full_key in self._entries:
                self._bytes -= self._sizes[full_key]
            self._entries[full_key] = stored
            self._sizes[full_key] = size
            self._bytes += size
            self._entries.move_to_end(full_key)
            while len(self._entries) > self.capacity or (
                    self.max_bytes is not None and self._bytes > self.max_bytes):
                old, _ = self._entries.popitem(last=False)
                self._bytes -= self._sizes.pop(old)
                self.evictions += 1
        return value

    def clear(self) -> None:
        """Drop every entry (counters are kept)."""
        with self._lock:
            self._entries.clear()
            self._sizes.clear()
            self._bytes = 0

    def stats(self) -> dict[str, Any]:
        """Counters: ``capacity``, ``max_bytes``, ``size`` (entries), ``bytes`` (tensor storage held),
        ``hits``, ``misses``, ``evictions`` and ``hit_rate`` (hits / lookups, 0 when none)."""
        with self._lock:
            size = len(self._entries)
            nbytes = self._bytes
            lookups = self.hits + self.misses
            return {
                "capacity": self.capacity,
                "max_bytes": self.max_bytes,
                "size": size,
                "bytes": nbytes,
                "hits": self.hits,
                "misses": self.misses,
                "evictions": self.evictions,
                "hit_rate": self.hits / lookups if lookups else 0.0,
            }


def _nbytes(tensors: tuple[torch.Tensor | None, ...]) -> int:
    """Bytes of tensor storage held by `tensors` (None counts 0)."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)
