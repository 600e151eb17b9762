"""Text encoding shared by every family: through the prompt-embedding cache, with absurdly
long text cut before it reaches a tokenizer, and batched across the requests prepared together.

Each text (prompt or negative prompt) gets one row, exactly as diffusers' ``encode_prompt``
encodes each list element (the negative prompt is a separate encoder forward there too), and
is cached per text; a request repeats the rows for its images at use. So the cache holds one
entry per distinct text (the shared empty negative prompt is one entry for everyone), and its
size does not grow with ``num_images_per_prompt``.

Families whose encoders pad every text to a fixed length (SD3's CLIP + T5, Flux's CLIP + T5,
SD 1.x/2.x and SDXL's CLIPs) encode several texts in ONE encoder forward with the same rows as one at a time
(`TextEncoder.encoding_together`): the requests admitted together (a burst of arrivals, a wave
of a closed loop) cost one forward per encoder instead of one per text, which on the built-in
model's CPU path is 16 texts in ~8-17 ms instead of ~95-110 ms.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

import torch

#: No tokenizer diffserve serves maps more than this many characters to one token (CLIP BPE,
#: T5/UMT5 unigram and Qwen byte-level BPE pieces are all shorter; runs of whitespace aside), so
#: cutting text at ``limit * MAX_CHARS_PER_TOKEN`` characters keeps every token the encoder
#: would keep and spares tokenizing the rest (a 32,000-character prompt took ~1 s to tokenize).
MAX_CHARS_PER_TOKEN = 32

#: Texts whose truncation verdict `TextEncoder.is_truncated` remembers (least recently used
#: forgotten first), each of at most `TRUNCATION_MEMO_CHARS` characters (so at most ~4 MB):
#: tokenizing a prompt with every tokenizer (~50-100 us each) was a third of a request's
#: prepare time when its embeddings came from the prompt cache.
TRUNCATION_MEMO_SIZE = 4096
TRUNCATION_MEMO_CHARS = 1024

#: Most texts one batched encoder call takes (`TextEncoder.encoding_together`).
MAX_TEXTS_PER_ENCODE = 32

logger = logging.getLogger(__name__)


class PromptCache(Protocol):
    """What text encoding needs of a prompt-embedding cache (the acceleration layer's
    `diffserve.acceleration.prompt_embed_cache.PromptEmbedCache` is one; the model runner
    installs it as ``adapter.prompt_embed_cache``). Keys are tuples of hashables."""

    def __contains__(self, key: Sequence[Hashable]) -> bool:
        """Whether `key` is cached (counts as neither hit nor miss)."""

    def get_or_encode(self, key: Sequence[Hashable],
                      encode: Callable[[], tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
        """The cached encoding of `key` (fresh tensors the caller owns), or ``encode()``'s,
        cached."""


class TextLoras(Protocol):
    """The text-encoder LoRA adapters of the request(s) whose texts are being encoded (the
    runner installs one around a request's preparation, `TextEncoder.using_loras`)."""

    #: identifies the adapters and their scales (part of every prompt-cache key).
    key: Hashable

    def active(self) -> Any:
        """A context manager within which the text encoders add these adapters' deltas."""


class TextOwner(Protocol):
    """What a `TextEncoder` reads of its owner (a step adapter): the prompt-embedding cache
    the runner installs (or None), and the dtype and device in every cache key."""

    prompt_embed_cache: PromptCache | None
    dtype: torch.dtype
    device: torch.device


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
        batched: `encode` also takes a list of texts and returns tensors with one row per
            text, in order, each row what the text alone gives (every encoder pads to a fixed
            length): `encoding_together` then encodes several texts in one call.
        clean: what the family's encoding does to a text before tokenizing it (e.g. Wan's
            ``prompt_clean``), applied when `is_truncated` counts tokens; None = nothing.
    """

    def __init__(self, adapter: TextOwner, encode: Callable[[str, int | None], Sequence[Any]],
                 tokenizers: Sequence[tuple[Any, int | None]], key: Hashable = (), batched: bool = False,
                 clean: Callable[[str], str] | None = None):
        self.adapter = adapter
        self.clean = clean
        self._encode = encode
        self.tokenizers = [(t, limit) for t, limit in tokenizers if t is not None]
        self.key = key
        self.batched = batched
        self._truncated: OrderedDict[tuple[str, int | None], bool] = OrderedDict()
        self._together: dict[tuple, tuple[torch.Tensor, ...]] = {}
        #: the text-encoder LoRA adapters in force (`using_loras`), None = none
        self.loras: TextLoras | None = None

    @contextmanager
    def using_loras(self, loras: TextLoras | None) -> Iterator[None]:
        """Within the block, texts are encoded with `loras` (a request's text-encoder LoRA
        adapters; None or an empty key: none) and cached under their key. One thread at a time."""
        previous = self.loras
        self.loras = loras if loras is not None and loras.key else None
        try:
            yield
        finally:
            self.loras = previous

    def _run_encode(self, *args: Any, **kwargs: Any) -> tuple:
        if self.loras is None:
            return tuple(self._encode(*args, **kwargs))
        with self.loras.active():
            return tuple(self._encode(*args, **kwargs))

    def cut(self, text: str, max_sequence_length: int | None = None) -> str:
        """`text` cut to the longest token budget x `MAX_CHARS_PER_TOKEN` characters."""
        limits = [limit if limit is not None else (max_sequence_length or 0) for _, limit in self.tokenizers]
        budget = max(limits, default=0) * MAX_CHARS_PER_TOKEN
        return text[:budget] if budget and len(text) > budget else text

    def is_truncated(self, text: str, max_sequence_length: int | None = None) -> bool:
        """Whether any tokenizer's ids for `text` exceed its limit (the encoder drops the
        rest). Remembered for the last `TRUNCATION_MEMO_SIZE` texts of up to
        `TRUNCATION_MEMO_CHARS` characters. Tokenizers are not thread-safe: call from one
        thread at a time."""
        if len(text) > TRUNCATION_MEMO_CHARS:
            return self._tokenize_is_truncated(text, max_sequence_length)
        key = (text, max_sequence_length)
        verdict = self._truncated.get(key)
        if verdict is None:
            verdict = self._tokenize_is_truncated(text, max_sequence_length)
            self._truncated[key] = verdict
            if len(self._truncated) > TRUNCATION_MEMO_SIZE:
                self._truncated.popitem(last=False)
        else:
            self._truncated.move_to_end(key)
        return verdict

    def _tokenize_is_truncated(self, text: str, max_sequence_length: int | None) -> bool:
        if self.clean is not None:
            text = self.clean(text)
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
        key = self._key(text, max_sequence_length, extra_key)

        def run() -> tuple[torch.Tensor, ...]:
            together = self._together.get(key)  # encoded with others (`encoding_together`)
            if together is not None:  # a copy: the caller owns it, and a text may repeat
                return tuple(None if t is None else t.clone() for t in together)
            return self._run_encode(text, max_sequence_length, **encode_inputs)

        if cache is None:
            return run()
        return cache.get_or_encode(key, run)

    def _key(self, text: str, max_sequence_length: int | None, extra_key: Hashable = ()) -> tuple:
        """The prompt-cache key of an already `cut` text (with the text-encoder LoRA adapters in
        force: they change the encoding)."""
        loras = self.loras.key if self.loras is not None else ()
        return (type(self.adapter).__name__, text, max_sequence_length, self.key, extra_key,
                str(self.adapter.dtype), str(self.adapter.device), loras)

    @contextmanager
    def encoding_together(self, texts: Iterable[tuple[str, int | None]]) -> Iterator[None]:
        """Within the block, `encode` of any of `texts` ((text, max_sequence_length) pairs,
        e.g. every prompt and negative prompt of the requests being prepared) takes its row of
        one batched encoder call per max_sequence_length (at most `MAX_TEXTS_PER_ENCODE` texts
        each) made on entry for the distinct texts not in the prompt cache. A no-op unless the
        family's encoding is `batched`, or when fewer than 2 texts need encoding. A batched
        call that raises is logged and skipped: each text is then encoded alone, so a bad one
        fails only its own request. Each text keeps its own tensors, one row each ((1, L, D)
        prompt_embeds, (1, P) pooled, ... as `encode` returns them), copied out of the batch so
        it can be freed. Call from one thread at a time (tokenizers)."""
        if not self.batched:
            yield
            return
        cache = self.adapter.prompt_embed_cache
        groups: dict[int | None, list[str]] = {}
        for text, max_sequence_length in texts:
            text = self.cut(text, max_sequence_length)
            group = groups.setdefault(max_sequence_length, [])
            key = self._key(text, max_sequence_length)
            if text not in group and key not in self._together and (cache is None or key not in cache):
                group.append(text)
        try:
            for max_sequence_length, group in groups.items():
                if len(group) < 2:  # one new text: encoded alone when asked, as without batching
                    continue
                for start in range(0, len(group), MAX_TEXTS_PER_ENCODE):
                    chunk = group[start:start + MAX_TEXTS_PER_ENCODE]
                    try:
                        out = self._run_encode(chunk, max_sequence_length)
                    except Exception:  # noqa: BLE001 - fall back to one text at a time
                        logger.warning("batched encoding of %d texts failed; encoding them one by one",
                                       len(chunk), exc_info=True)
                        continue
                    for i, text in enumerate(chunk):
                        self._together[self._key(text, max_sequence_length)] = tuple(
                            None if t is None else t[i:i + 1].clone() for t in out)
            yield
        finally:
            self._together = {}


def repeat_rows(tensor: Any, n: int) -> Any:
    """A one-row tensor repeated to `n` rows (dim 0); None and n == 1 unchanged."""
    if tensor is None or n == 1:
        return tensor
    return tensor.repeat(n, *([1] * (tensor.dim() - 1)))
