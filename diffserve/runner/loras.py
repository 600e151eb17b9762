"""`RunnerLoras`: what the model runner does for LoRA adapters: read files (on the executor's
loader thread, beside the steps), keep them in the slot pool (`diffserve.lora.pool`), pin a
request's adapters from its preparation to its end, encode its prompt with its text-encoder
adapters, and lay a step batch's adapters over the denoiser's rows.

The pool is made when the first adapter loads, or at startup under ``compile`` when adapters
may come (``loras``, ``lora_dir`` or a built-in model's own): every linear / conv layer is then
hooked before the warm-up, which also runs with LoRA rows, so no adapter recompiles later.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

from diffserve.config import EngineConfig
from diffserve.core.errors import InvalidRequestError
from diffserve.lora.pool import LoraPool
from diffserve.lora.rows import ROW_KEY, RowLoras
from diffserve.pipelines.base import PipelineAdapter, RequestState


@dataclass(frozen=True)
class TextLoras:
    """A request's text-encoder adapters (`diffserve.pipelines.text_encoding.TextLoras`):
    ``key`` = ((name, load generation, scale), ...) for the prompt cache, ``pairs`` their
    slots for the encoders."""

    key: tuple
    pairs: RowLoras
    pool: LoraPool

    def active(self):
        return self.pool.encoding(self.pairs)


class RunnerLoras:
    """LoRA adapters of one model runner.

    Args:
        adapter: the loaded pipeline adapter (its ``pipe`` is the diffusers pipeline).
        config: ``max_loras``, ``max_lora_rank``, ``compile`` and the LoRA sources are read.
    """

    def __init__(self, adapter: PipelineAdapter, config: EngineConfig):
        from diffserve.models import builtin_loras

        self.adapter = adapter
        self.config = config
        self.pipe = getattr(adapter, "pipe", None)
        self._pool: LoraPool | None = None
        self._lock = threading.Lock()
        self._generations: dict[str, int] = {}
        self._counter = itertools.count(1)
        may_load = bool(config.loras or config.lora_dir or builtin_loras(config.model))
        if config.compile and may_load and self.pipe is not None:
            self._pool = self._new_pool(hook_all=True)

    def _new_pool(self, hook_all: bool) -> LoraPool:
        return LoraPool(self.pipe, self.config.max_loras, self.config.max_lora_rank, self.adapter.device,
                        self.adapter.dtype, hook_all=hook_all)

    @property
    def pool(self) -> LoraPool | None:
        """The slot pool (None until an adapter loads, unless made at startup)."""
        return self._pool

    # ------------------------------------------------------------------ loading
    def load(self, name: str, path: str) -> dict[str, Any]:
        """Read the adapter at `path` and keep it as `name` (replacing an unused one of that
        name). Safe beside the steps: only the pool's own lock is held while it is added.

        Returns:
            Its summary (format, rank, modules per component, bytes).

        Raises:
            InvalidRequestError: (field ``path``) unreadable, of an unsupported kind, not
                matching the model, or of a rank above ``max_lora_rank``; or the model has no
                diffusers pipeline to read LoRA for.
            LoraInUseError: requests hold an adapter of that name.
        """
        from diffserve.lora.reading import read_lora

        if self.pipe is None:
            raise InvalidRequestError("path", path, f"unset: {self.adapter.pipeline_class_name} has no diffusers "
                                      "pipeline to load LoRA into")
        adapter = read_lora(path, self.pipe, name)
        with self._lock:
            if self._pool is None:
                self._pool = self._new_pool(hook_all=False)
            self._pool.add(adapter)
            self._generations[name] = next(self._counter)
        return adapter.info()

    def unload(self, name: str) -> None:
        """Forget adapter `name` (its host copy and slot).

        Raises:
            LoraInUseError: requests hold it.
        """
        if self._pool is not None:
            self._pool.remove(name)
            self._generations.pop(name, None)

    # ------------------------------------------------------------------ requests
    def acquire(self, state: RequestState) -> None:
        """Pin the request's adapters in device slots and set its row data ``"loras"`` (sorted
        ``(slot, scale)`` pairs; collation lays them out per row).

        Raises:
            InvalidRequestError: (field ``loras``) an adapter is not loaded on this worker.
            LoraSlotsFullError: no slot left (the request scheduler prevents it).
        """
        loras = state.params.loras
        state.row_data.pop(ROW_KEY, None)
        if not loras:
            return
        if self._pool is None:
            raise InvalidRequestError("loras", loras, "names of loaded LoRA adapters (none is loaded)")
        try:
            state.row_data[ROW_KEY] = self._pool.acquire(loras)
        except KeyError as exc:
            raise InvalidRequestError("loras", loras, "names of loaded LoRA adapters", detail=str(exc)) from None

    def release(self, state: RequestState) -> None:
        """Unpin what `acquire` pinned for `state` (once: its row data ``"loras"`` is
        removed)."""
        if state.row_data.pop(ROW_KEY, None) and self._pool is not None:
            self._pool.release(list(state.params.loras or ()))

    def text_key(self, loras: dict[str, float] | None) -> tuple:
        """The prompt-cache key part of a request's text-encoder adapters (names, load
        generations and scales): requests with equal keys encode texts alike."""
        if not loras or self._pool is None:
            return ()
        pool = self._pool
        return tuple(sorted((name, self._generations.get(name, 0), float(scale)) for name, scale in loras.items()
                            if name in pool.adapters and any(c.startswith("text_encoder")
                                                             for c in pool.adapters[name].components)))

    @contextmanager
    def encoding(self, loras: dict[str, float] | None) -> Iterator[None]:
        """Within the block, the adapter's text encoding (`TextEncoder`) uses the text-encoder
        adapters of `loras` (pinned for the block) and caches under their key."""
        text = self.adapter.text
        key = self.text_key(loras)
        if text is None or not key:
            yield
            return
        names = [name for name, _, _ in key]
        pairs = self._pool.acquire({name: scale for name, _, scale in key})
        try:
            with text.using_loras(TextLoras(key, pairs, self._pool)):
                yield
        finally:
            self._pool.release(names)

    def denoising(self, batch: Any):
        """The context of a step batch's denoiser forward: each row adds its adapters
        (its row data ``"loras"``); nothing when the pool does not exist."""
        if self._pool is None:
            return nullcontext()
        rows = batch.row_data.get(ROW_KEY)
        return self._pool.denoising(tuple(r or () for r in rows) if rows else None)

    def warmup_contexts(self) -> list:
        """Contexts the compile warm-up runs its forwards in: without LoRA rows, and (with a
        pool made at startup) with LoRA rows of an empty slot, so both graph variants exist."""
        if self._pool is None:
            return [nullcontext]
        pool = self._pool
        return [nullcontext, lambda: pool.denoising_all(((0, 0.0),))]
