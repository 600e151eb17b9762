"""`PromptEmbedCache`: an LRU of text-encoder outputs, so a repeated prompt skips encoding.

Serving traffic repeats prompts (retries, several seeds of one prompt, the empty negative
prompt); the text encoders (CLIP x2, plus T5-XXL on real SD3) then recompute the same
embeddings. The cache maps every argument that changes the encoding to the encoder's output
tensors.
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

    Raises:
        ValueError: capacity < 1.
    """

    def __init__(self, capacity: int, model: str = ""):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.model = model
        self._entries: OrderedDict[Hashable, tuple[torch.Tensor, ...]] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

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
                return tuple(t.clone() for t in cached)
            self.misses += 1
        value = tuple(encode())
        stored = tuple(t.detach().clone() for t in value)
        with self._lock:
            self._entries[full_key] = stored
            self._entries.move_to_end(full_key)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)
                self.evictions += 1
        return value

    def clear(self) -> None:
        """Drop every entry (counters are kept)."""
        with self._lock:
            self._entries.clear()

    def stats(self) -> dict[str, Any]:
        """Counters: ``capacity``, ``size`` (entries), ``bytes`` (tensor storage held),
        ``hits``, ``misses``, ``evictions`` and ``hit_rate`` (hits / lookups, 0 when none)."""
        with self._lock:
            size = len(self._entries)
            nbytes = sum(t.numel() * t.element_size() for v in self._entries.values() for t in v)
            lookups = self.hits + self.misses
            return {
                "capacity": self.capacity,
                "size": size,
                "bytes": nbytes,
                "hits": self.hits,
                "misses": self.misses,
                "evictions": self.evictions,
                "hit_rate": self.hits / lookups if lookups else 0.0,
            }
