"""Sleep mode: give the device's memory back between bursts, with vLLM's semantics.

- **Level 1** moves the weights off the device and keeps them, so waking is a copy back:
  on a GPU they go to CPU memory (pinned when possible); on a CPU device, where the device
  memory IS the process's memory, "off the device" means out of RAM: they are written to a
  spill folder on disk (raw files under the system temp folder, ``TMPDIR``) and read back on
  wake. Weights of a GPU engine that already live on the CPU (offloaded ones) stay where they
  are.
- **Level 2** discards every weight; waking reloads them from the model folder (the loader
  runs again: weight files are read again, and ``load_format="dummy"`` re-creates the same
  seeded random weights), so nothing is kept anywhere while asleep.

Both levels also drop what is cached on the device for requests (the prompt-embedding cache,
the analogue of vLLM's KV cache; done by the runner) and hand freed memory back
(``torch.cuda.empty_cache`` on a GPU, ``malloc_trim`` on CPU). A woken model has byte-identical
weights, so it produces byte-identical outputs.

Weights are swapped in place (``tensor.data``), keeping every parameter and buffer object:
hooks, compiled code and the adapter keep their references. A buffer that is a view of
another tensor (e.g. SD3's positional embedding) is replaced in its module instead, since the
view would keep its base's memory alive. Level 1 works per storage, so tensors that shared
storage (tied weights, a packed pool) share it again after waking. A quantized weight that is a
tensor subclass (torchao's ``Int8Tensor``, ``Float8Tensor``, ...) is handled through the plain
tensors it holds (int8 data, scales: `diffserve.core.tensor_storage.inner_tensors`), each
swapped in its wrapper, so quantized weights sleep and wake as they are (level 2 reloads the
folder and the runner quantizes it again the same way).

**The sleep pool** (``EngineConfig.enable_sleep_mode``, vLLM's flag of the same name; vLLM
allocates weights from a dedicated memory pool for the same reason): memory freed by a sleep
goes back to the OS only where the allocator can give it back. Small tensors (biases, norms)
share heap pages or allocator segments with other live data, so without the pool a sleep
returns a little less than the weights' size (~0.2% on a 227 MiB model here, see
tests/memory/test_memory.py). With the pool, each component's weights are packed into one block at
load (CPU: a page-aligned anonymous memory mapping, unmapped as a whole when freed; CUDA: one
allocation, its own allocator segment), and again after each wake, so a sleep returns all of
it. Components that offload moves between devices are not pooled (a move unpacks them).
"""

from __future__ import annotations

import logging
import mmap
import shutil
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from diffserve.core.sleep_levels import check_level
from diffserve.core.tensor_storage import inner_tensors, is_wrapper, set_inner
from diffserve.memory.accounting import release_host_memory

logger = logging.getLogger(__name__)

#: Alignment of each tensor inside a pool block, bytes.
_ALIGN = 64


@dataclass
class _Weight:
    """One parameter or buffer (or one inner tensor of a tensor-subclass weight) and where its
    bytes live."""

    key: str
    component: str
    name: str
    tensor: torch.Tensor
    #: (module, buffer name) of a view buffer, replaced in the module rather than swapped
    owner: tuple[torch.nn.Module, str] | None
    device: torch.device
    dtype: torch.dtype
    shape: torch.Size
    stride: tuple[int, ...]
    offset: int
    storage: int = -1
    #: (wrapper tensor, attribute path) of an inner tensor of a tensor subclass, replaced there
    wrapper: tuple[torch.Tensor, str] | None = None

    @property
    def nbytes(self) -> int:
        return self.shape.numel() * self.dtype.itemsize

    def assign(self, value: torch.Tensor) -> None:
        """Make the weight hold `value`."""
        if self.wrapper is not None:
            set_inner(*self.wrapper, value)
            self.tensor = value
        elif self.owner is not None:
            module, local = self.owner
            module._buffers[local] = value
            self.tensor = value
        else:
            self.tensor.data = value


@dataclass
class _Storage:
    """A storage put to sleep at level 1: its bytes on the CPU or in a spill file."""

    device: torch.device
    nbytes: int
    saved: torch.Tensor | None = None
    path: Path | None = None
    weights: list[_Weight] = field(default_factory=list)


def _canonical(name: str) -> str:
    """A tensor name without wrapper prefixes (``torch.compile``'s ``_orig_mod.``)."""
    return ".".join(part for part in name.split(".") if part != "_orig_mod")


def _weights(component: str, module: torch.nn.Module, seen: set[int]) -> list[_Weight]:
    buffers = {id(t) for t in module.buffers()}
    out = []
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        if id(t) in seen:
            continue
        seen.add(id(t))
        if is_wrapper(t):  # a tensor subclass: its plain inner tensors, swapped inside it
            for path, inner in inner_tensors(t):
                if id(inner) not in seen:
                    seen.add(id(inner))
                    key = f"{_canonical(name)}.{path}"
                    out.append(_Weight(f"{component}/{key}", component, key, inner, None,
                                       inner.device, inner.dtype, inner.shape, tuple(inner.stride()),
                                       inner.storage_offset(), wrapper=(t, path)))
            continue
        owner = None
        if id(t) in buffers and t._base is not None:
            prefix, _, local = name.rpartition(".")
            owner = (module.get_submodule(prefix) if prefix else module, local)
        name = _canonical(name)
        out.append(_Weight(f"{component}/{name}", component, name, t, owner, t.device, t.dtype, t.shape,
                           tuple(t.stride()), t.storage_offset()))
    return out


def _device_map(weights: list[_Weight]) -> dict[str, torch.device | dict[str, torch.device]]:
    """Each component's device, or its per-tensor devices when they differ."""
    per: dict[str, dict[str, torch.device]] = {}
    for w in weights:
        per.setdefault(w.component, {})[w.name] = w.device
    return {c: next(iter(d.values())) if len(set(d.values())) == 1 else d for c, d in per.items()}


def allocate_bytes(nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 tensor of `nbytes` whose memory goes back to the OS as a whole when freed:
    on CPU a page-aligned anonymous memory mapping, on a GPU one allocation."""
    if device.type == "cpu" and nbytes > 0:
        return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def _storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """The whole storage of `t` as a flat uint8 tensor (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def _view(buffer: torch.Tensor, w: _Weight, offset: int | None = None) -> torch.Tensor:
    """Weight `w` as a view of the uint8 `buffer` at element offset `offset` (default: its
    own offset and strides)."""
    storage = buffer.untyped_storage()
    if offset is None:
        return torch.empty(0, dtype=w.dtype, device=buffer.device).set_(storage, w.offset, w.shape, w.stride)
    return torch.empty(0, dtype=w.dtype, device=buffer.device).set_(storage, offset, w.shape)


@torch.inference_mode(False)
@torch.no_grad()
def pack_weights(modules: dict[str, torch.nn.Module]) -> int:
    """Pack each module's parameters and buffers into one block (`allocate_bytes`), the
    sleep pool; returns the bytes packed. A module already in one block, or with tensors on
    several devices, is left alone."""
    total = 0
    for component, module in modules.items():
        weights = _weights(component, module, set())
        devices = {w.device for w in weights}
        storages = {(w.tensor.untyped_storage().data_ptr(), w.device) for w in weights if w.nbytes}
        if not weights or len(devices) != 1 or len(storages) <= 1:
            continue
        offsets, at = [], 0
        for w in weights:
            at = -(-at // _ALIGN) * _ALIGN
            offsets.append(at)
            at += w.nbytes
        block = allocate_bytes(at, devices.pop())
        for w, offset in zip(weights, offsets):
            view = _view(block, w, offset // w.dtype.itemsize)
            view.copy_(w.tensor)
            w.assign(view)
        total += at
    return total


class WeightSleeper:
    """Puts the weights of a set of modules to sleep and wakes them (see the module
    docstring).

    Args:
        modules: returns the model's modules by component name (``adapter.modules()``).
        reload: returns freshly loaded components by the same names (level-2 wake).
        device: the compute device.
        pool: returns the components to keep in the sleep pool (packed again after each
            wake), or None for no pool.

    Attributes:
        level: the current sleep level, None while awake.
        bytes_slept: bytes of the weights put to sleep by the last `sleep`.
    """

    def __init__(self, modules: Callable[[], dict[str, torch.nn.Module]],
                 reload: Callable[[], dict[str, Any]], device: torch.device,
                 pool: Callable[[], Iterable[str]] | None = None):
        self.modules = modules
        self.reload = reload
        self.device = device
        self.pool = pool
        self.level: int | None = None
        self.bytes_slept = 0
        self._weights: list[_Weight] = []  # level 1: what was moved off the device
        self._storages: list[_Storage] = []
        self._spill: Path | None = None
        #: level 2: each component's device (or per-tensor devices when mixed); kept small,
        #: since it stays in memory while asleep
        self._devices: dict[str, torch.device | dict[str, torch.device]] = {}

    def pack(self) -> int:
        """Pack the pool's components (see `pack_weights`); 0 without a pool."""
        if self.pool is None:
            return 0
        modules = self.modules()
        return pack_weights({name: modules[name] for name in self.pool() if name in modules})

    def _collect(self) -> list[_Weight]:
        seen: set[int] = set()
        return [w for component, module in self.modules().items() for w in _weights(component, module, seen)]

    @staticmethod
    def _drop(w: _Weight) -> None:
        w.assign(torch.empty(0, dtype=w.dtype, device=w.device))

    @torch.inference_mode(False)
    @torch.no_grad()
    def sleep(self, level: int) -> None:
        """Level 1: move the weights off the device; level 2: discard every weight (see the
        module docstring). Sleeping deeper while asleep at level 1 discards what level 1 kept;
        sleeping again at the same or a lower level does nothing.

        Raises:
            InvalidRequestError: `level` is not 1 or 2.
        """
        level = check_level(level)
        if self.level is not None:
            if level > self.level:  # 1 -> 2: forget the kept bytes and what stayed in place
                slept = {w.key for w in self._weights}
                extra = [w for w in self._collect() if w.key not in slept]
                for w in extra:
                    self._drop(w)
                self._devices = _device_map(self._weights + extra)
                self._weights, self._storages = [], []
                self._remove_spill()
                self.bytes_slept += sum(w.nbytes for w in extra)
                self.level = level
                self._release()
            return
        weights = self._collect()
        if level == 1 and self.device.type != "cpu":
            weights = [w for w in weights if w.device.type != "cpu"]
        self.bytes_slept = sum(w.nbytes for w in weights)
        if level == 1:
            self._weights = weights
            self._keep_off_device()
        else:
            self._devices = _device_map(weights)
        for w in weights:
            self._drop(w)
        del weights
        self.level = level
        self._release()
        logger.info("sleeping at level %d: %.1f MiB of weights %s", level, self.bytes_slept / 2**20,
                    "off the device" if level == 1 else "discarded")

    def _keep_off_device(self) -> None:
        """Level 1: copy every storage holding slept weights to the CPU (GPU engine) or to a
        spill file (CPU engine)."""
        index: dict[tuple[int, str], int] = {}
        for w in self._weights:
            if w.nbytes == 0:
                continue
            storage = w.tensor.untyped_storage()
            key = (storage.data_ptr(), str(w.device))
            if key not in index:
                index[key] = len(self._storages)
                self._storages.append(_Storage(w.device, storage.nbytes()))
            w.storage = index[key]
            self._storages[w.storage].weights.append(w)
        if self.device.type == "cpu":
            self._spill = Path(tempfile.mkdtemp(prefix="diffserve-sleep-"))
        for i, storage in enumerate(self._storages):
            data = _storage_bytes(storage.weights[0].tensor)
            if self._spill is not None:
                storage.path = self._spill / f"{i}.bin"
                data.numpy().tofile(storage.path)
            else:
                try:
                    storage.saved = torch.empty(storage.nbytes, dtype=torch.uint8, pin_memory=True)
                except RuntimeError:
                    storage.saved = torch.empty(storage.nbytes, dtype=torch.uint8)
                storage.saved.copy_(data)

    @torch.inference_mode(False)
    @torch.no_grad()
    def wake_up(self) -> None:
        """Restore the weights where they were (no-op while awake), then pack the pool.

        Raises:
            RuntimeError: a reloaded component lacks a tensor, or its shape/dtype differ (the
                model folder changed while asleep).
        """
        if self.level is None:
            return
        if self.level == 2:
            self._reload_from_folder()
        else:
            for storage in self._storages:
                block = allocate_bytes(storage.nbytes, storage.device)
                if storage.path is not None:
                    with open(storage.path, "rb") as f:
                        f.readinto(memoryview(block.numpy()))
                else:
                    block.copy_(storage.saved, non_blocking=storage.saved.is_pinned())
                for w in storage.weights:
                    w.assign(_view(block, w))
            for w in self._weights:
                if w.nbytes == 0:
                    w.assign(torch.empty(w.shape, dtype=w.dtype, device=w.device))
            self._remove_spill()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._weights, self._storages = [], []
        self.level = None
        self.pack()
        logger.info("awake: %.1f MiB of weights restored", self.bytes_slept / 2**20)

    def _reload_from_folder(self) -> None:
        fresh = self.reload()
        modules = self.modules()
        seen: set[int] = set()
        for component, devices in self._devices.items():
            module = fresh.get(component)
            if not isinstance(module, torch.nn.Module) or component not in modules:
                raise RuntimeError(f"cannot wake up: the reloaded model has no component {component!r}")
            source = {w.name: w.tensor for w in _weights(component, module, set())}
            for w in _weights(component, modules[component], seen):
                src = source.get(w.name)
                if src is None or src.dtype != w.dtype:
                    raise RuntimeError(f"cannot wake up: {w.key} differs in the reloaded model "
                                       "(did the model folder change while asleep?)")
                device = devices if isinstance(devices, torch.device) else devices[w.name]
                w.assign(src.data.to(device))
            fresh[component] = None  # free the rest of the fresh module early
        self._devices = {}

    def _remove_spill(self) -> None:
        if self._spill is not None:
            shutil.rmtree(self._spill, ignore_errors=True)
            self._spill = None

    def _release(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        release_host_memory()
