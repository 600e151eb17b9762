"""`LoraPool`: the adapters of one served pipeline: host copies by name, ``max_loras`` device
slots shared by every adapted module, and the hooks that add each row's deltas.

A request holds (pins) the slots of its adapters from `acquire` (prepare) to `release` (free);
an adapter no request holds stays resident until its slot is needed (least recently used
first), so a popular adapter is copied to the device once. The request scheduler never admits
more distinct adapters than there are slots (`acquire` raises otherwise).

Modules are hooked the first time an adapter writes to them (``hook_all``: every linear and
conv layer of the LoRA-loadable components at construction, so a compiled model sees all its
hooks before its warm-up and no later adapter changes a graph).
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from diffserve.core.errors import InvalidRequestError, LoraInUseError
from diffserve.lora.reading import loadable_components
from diffserve.lora.rows import LoraModuleSlots, LoraPlan, LoraSwitch, PlanCache, RowLoras, install_hook
from diffserve.lora.weights import LoraAdapter


class LoraSlotsFullError(RuntimeError):
    """Every device slot holds an adapter that running requests use."""


def is_text_encoder(component: str) -> bool:
    """Whether a pipeline component is a text encoder (diffusers' ``text_encoder*`` names)."""
    return component.startswith("text_encoder")


class LoraPool:
    """Adapters and their device slots for one pipeline.

    Args:
        pipe: the served diffusers pipeline (its LoRA-loadable components are hooked).
        max_loras: device slots: most distinct adapters used by requests at once.
        max_rank: largest adapter rank accepted (slots are padded to it).
        device / dtype: where and in what dtype slots live (the model's).
        hook_all: hook every linear / conv layer now (for compiled models).
    """

    def __init__(self, pipe: Any, max_loras: int, max_rank: int, device: torch.device, dtype: torch.dtype,
                 hook_all: bool = False):
        if max_loras < 1 or max_rank < 1:
            raise ValueError(f"max_loras and max_rank must be >= 1, got {max_loras}, {max_rank}")
        self.pipe = pipe
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.device = torch.device(device)
        self.dtype = dtype
        self.components = {c: getattr(pipe, c) for c in loadable_components(pipe)}
        #: plans of the denoiser(s) and of the text encoders: separate, so a prompt encoded on
        #: the prepare thread never sees the step's plan
        self.denoise = LoraSwitch()
        self.text = LoraSwitch()
        self.adapters: dict[str, LoraAdapter] = {}
        self.resident: list[str | None] = [None] * max_loras
        self._written: list[list[LoraModuleSlots]] = [[] for _ in range(max_loras)]
        self._pins: Counter[str] = Counter()
        self._recent: OrderedDict[str, None] = OrderedDict()
        self._slots: dict[tuple[str, str], LoraModuleSlots] = {}
        self._hooks: dict[tuple[str, str], Any] = {}
        self._plans = PlanCache()
        self._lock = threading.RLock()
        if hook_all:
            for component, root in self.components.items():
                for path, module in root.named_modules():
                    if isinstance(module, (torch.nn.Linear, torch.nn.modules.conv._ConvNd)):
                        self._module_slots(component, path)

    # ------------------------------------------------------------------ host copies
    def add(self, adapter: LoraAdapter) -> None:
        """Keep `adapter` (host copy) under its name, replacing an unused one of that name.

        Raises:
            InvalidRequestError: (field ``path``) its rank exceeds ``max_rank``.
            LoraInUseError: an adapter of that name is held by requests.
        """
        if adapter.rank > self.max_rank:
            raise InvalidRequestError("path", adapter.source, f"a LoRA of rank <= {self.max_rank} (--max-lora-rank)",
                                      detail=f"its rank is {adapter.rank}")
        with self._lock:
            if adapter.name in self.adapters:
                self.remove(adapter.name)
            self.adapters[adapter.name] = adapter

    def remove(self, name: str) -> None:
        """Forget adapter `name` (host copy and slot; unknown names are ignored).

        Raises:
            LoraInUseError: requests hold it.
        """
        with self._lock:
            if self._pins[name]:
                raise LoraInUseError(f"LoRA {name!r} is used by {self._pins[name]} request(s)")
            if name in self.resident:
                self._clear_slot(self.resident.index(name))
            self.adapters.pop(name, None)
            self._recent.pop(name, None)
            self._pins.pop(name, None)

    # ------------------------------------------------------------------ slots
    def acquire(self, loras: Mapping[str, float]) -> RowLoras:
        """Pin `loras`' adapters in device slots (copying those not resident) and return the
        request's row adapters: sorted ``(slot, scale)`` pairs.

        Raises:
            KeyError: an adapter is not in the pool.
            LoraSlotsFullError: no free or evictable slot is left for one of them.
        """
        with self._lock:
            for name in loras:
                if name not in self.adapters:
                    raise KeyError(f"LoRA {name!r} is not loaded")
            taken: list[str] = []
            try:
                for name in loras:
                    self._place(name)
                    self._pins[name] += 1
                    taken.append(name)
            except Exception:
                self.release(taken)
                raise
            return tuple(sorted((self.resident.index(name), float(scale)) for name, scale in loras.items()))

    def release(self, names: Sequence[str]) -> None:
        """Unpin adapters `acquire` pinned (their slots stay resident, evictable)."""
        with self._lock:
            for name in names:
                if self._pins[name] > 0:
                    self._pins[name] -= 1
                if not self._pins[name]:
                    self._pins.pop(name, None)

    def _place(self, name: str) -> None:
        if name in self.resident:
            self._recent.pop(name, None)
            self._recent[name] = None
            return
        slot = self._free_slot()
        adapter = self.adapters[name]
        written = []
        for component, modules in adapter.modules.items():
            for path, module in modules.items():
                slots = self._module_slots(component, path)
                slots.write(slot, module)
                written.append(slots)
        self.resident[slot] = name
        self._written[slot] = written
        self._recent[name] = None
        self._plans.clear()

    def _free_slot(self) -> int:
        if None in self.resident:
            return self.resident.index(None)
        for name in self._recent:  # least recently used first
            if not self._pins[name]:
                slot = self.resident.index(name)
                self._clear_slot(slot)
                return slot
        raise LoraSlotsFullError(f"all {self.max_loras} LoRA slots hold adapters in use (--max-loras)")

    def _clear_slot(self, slot: int) -> None:
        for slots in self._written[slot]:
            slots.write(slot, None)
        self._written[slot] = []
        name = self.resident[slot]
        self.resident[slot] = None
        if name is not None:
            self._recent.pop(name, None)
        self._plans.clear()

    def _module_slots(self, component: str, path: str) -> LoraModuleSlots:
        key = (component, path)
        slots = self._slots.get(key)
        if slots is None:
            module = self.components[component].get_submodule(path)
            module = getattr(module, "base_layer", module)
            slots = LoraModuleSlots(module, self.max_loras, self.max_rank, self.device, self.dtype)
            switch = self.text if is_text_encoder(component) else self.denoise
            self._hooks[key] = install_hook(slots, switch)
            self._slots[key] = slots
        return slots

    # ------------------------------------------------------------------ forwards
    @contextmanager
    def denoising(self, rows: Sequence[RowLoras] | None) -> Iterator[None]:
        """Within the block, denoiser forwards add each row's adapters (`rows`: per forward
        row, branch-major; None or all empty: nothing)."""
        if not rows or not any(rows):
            with self.denoise.use(None):
                yield
            return
        with self._lock:
            plan = self._plans.get(rows, self.device)
        with self.denoise.use(plan):
            yield

    @contextmanager
    def denoising_all(self, pairs: RowLoras) -> Iterator[None]:
        """Within the block, every row of any denoiser forward adds `pairs` (compile warm-up)."""
        with self.denoise.use(LoraPlan([pairs], self.device)):
            yield

    @contextmanager
    def encoding(self, pairs: RowLoras) -> Iterator[None]:
        """Within the block, text-encoder forwards add `pairs` to every row (one request's
        text-encoder adapters; any number of texts)."""
        if not pairs:
            with self.text.use(None):
                yield
            return
        with self.text.use(LoraPlan([pairs], self.device)):
            yield

    # ------------------------------------------------------------------ teardown and stats
    def close(self) -> None:
        """Remove every hook (the model runs as without LoRA)."""
        with self._lock:
            for handle in self._hooks.values():
                handle.remove()
            self._hooks.clear()
            self._slots.clear()

    def stats(self) -> dict[str, Any]:
        """``loaded`` (names), ``resident`` (slot -> name), ``pinned`` (name -> requests),
        ``host_bytes``, ``device_bytes``, ``hooked_modules``."""
        with self._lock:
            return {
                "loaded": sorted(self.adapters),
                "resident": list(self.resident),
                "pinned": dict(self._pins),
                "host_bytes": sum(a.nbytes for a in self.adapters.values()),
                "device_bytes": sum(s.nbytes for s in self._slots.values()),
                "hooked_modules": len(self._hooks),
            }
