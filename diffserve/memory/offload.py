"""Offload: serve a model whose weights do not all fit on the device.

Two mechanisms, usable together (`OffloadManager` runs both):

**Model CPU offload** (``EngineConfig.cpu_offload``), serving-aware. Components live on the CPU
and move to the device for their stage: the text encoders for prompt encoding (``encode``), the
denoiser(s) for denoising steps (``denoise``), the VAE for decoding (``decode``; an image input
also needs it at ``encode``). Unlike diffusers' ``enable_model_cpu_offload`` (one request's
pipeline call moves each component in and out in turn), the residency policy follows the
serving engine's work:

- a stage moves its components in when its work item starts; one work item carries every
  request the engine handed over together (all requests admitted in a step are encoded in one
  prepare item, all that finished in a step are decoded in one decode item), so one move serves
  many requests;
- components stay on the device after their work (no eviction on release): a component is
  evicted only when another stage must move in and the evicted one is idle, so repeated work
  of one stage never moves anything;
- the denoiser is never evicted while any request still has denoising steps to run (the
  runner says so through `OffloadManager.set_denoising`), so encodes and decodes of arriving
  and finishing requests never push it out mid-stream.

At most the denoiser and one other stage's components are on the device at once (both other
stages when an image input's encode needs the VAE): peak weights = denoiser + max(encoders, VAE)
while requests stream, and max(denoiser, encoders, VAE) for one request at a time. Every move in
is counted (`loads`); the runner reports the moves made for each request's work items in its
metrics (``offload_loads``).

**Layerwise offload** (``EngineConfig.layerwise_offload``): the denoiser's repeated blocks stay on
the CPU and stream to the device ``offload_blocks`` blocks at a time during each forward, with
diffusers' group offloading hooks (``diffusers.hooks.apply_group_offloading``, block level). On
a device with streams (CUDA) and one block per group, the next group is copied on a separate
stream while the current one computes (diffusers' lazy prefetching; ``offload_blocks > 1``
turns streams off, as diffusers streams one block at a time). The denoiser's small non-block
layers (patch/time/text embedders, output head) stay resident, so callers that run them
directly (TeaCache's split forward) need no forward of the whole model. Without
``cpu_offload`` the other components stay on the device.

On a CPU device the "device" and the CPU are the same memory: moves are no-ops, and only the
mechanics (stage residency, counts, hooks, outputs) are observable; memory savings need an
accelerator.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from diffserve.core.tensor_storage import tensor_bytes
from diffserve.memory.accounting import module_tensor_bytes

if TYPE_CHECKING:
    from diffserve.pipelines.base import PipelineAdapter

logger = logging.getLogger(__name__)

#: Work stages of the model runner.
STAGES = ("encode", "denoise", "decode")
#: Component names that are denoisers besides ``adapter.denoiser`` (second experts, UNets).
_DENOISER_NAMES = ("transformer", "transformer_2", "unet", "prior")
#: Where offloaded weights live.
HOME = torch.device("cpu")


def weights_device(config) -> torch.device:
    """Where an `EngineConfig`'s weights are loaded: the CPU when it offloads, else its
    device."""
    return HOME if (config.cpu_offload or config.layerwise_offload) else config.torch_device


def stage_components(adapter: "PipelineAdapter") -> dict[str, list[str]]:
    """Component names per stage, from ``adapter.modules()``: the denoiser(s) -> ``denoise``,
    the VAE -> ``decode``, every other module (text encoders, image encoders) -> ``encode``."""
    denoiser, vae = adapter.denoiser, adapter.vae
    stages: dict[str, list[str]] = {stage: [] for stage in STAGES}
    for name, module in adapter.modules().items():
        if module is denoiser or name in _DENOISER_NAMES:
            stages["denoise"].append(name)
        elif module is vae or name == "vae":
            stages["decode"].append(name)
        else:
            stages["encode"].append(name)
    return stages


#: The context of a stage whose components all stay where they are (reusable: no state).
_NOTHING_MOVED = contextlib.nullcontext(0)


def _move(module: torch.nn.Module, device: torch.device) -> None:
    # outside inference mode: the parameters must not turn into inference tensors
    with torch.inference_mode(False), torch.no_grad():
        module.to(device)


class LayerwiseOffload:
    """Block-level group offloading of denoiser modules (diffusers' hooks), see the module
    docstring.

    Args:
        modules: the denoiser modules by component name.
        device: the onload (compute) device.
        blocks_per_group: blocks moved together.
    """

    def __init__(self, modules: dict[str, torch.nn.Module], device: torch.device, blocks_per_group: int = 1):
        self.modules = modules
        self.device = device
        self.blocks_per_group = blocks_per_group
        self.use_stream = device.type == "cuda" and blocks_per_group == 1
        self.installed = False

    def apply(self) -> None:
        """Install the hooks: blocks go to the CPU, non-block layers to the device."""
        from diffusers.hooks import apply_group_offloading

        for module in self.modules.values():
            _move(module, HOME)
            with torch.inference_mode(False), torch.no_grad():
                apply_group_offloading(module, onload_device=self.device, offload_device=HOME,
                                       offload_type="block_level", num_blocks_per_group=self.blocks_per_group,
                                       use_stream=self.use_stream, non_blocking=self.use_stream)
                top = self._top_hook(module)
                if top is not None:  # keep the non-block layers resident
                    top.group.offload_device = self.device
                    top.group.onload_()
        self.installed = True

    def remove(self) -> None:
        """Remove the hooks (and their pinned CPU copies); every weight goes to the CPU."""
        from diffusers.hooks import HookRegistry
        from diffusers.hooks.group_offloading import (
            _GROUP_OFFLOADING,
            _LAYER_EXECUTION_TRACKER,
            _LAZY_PREFETCH_GROUP_OFFLOADING,
        )

        for module in self.modules.values():
            registry = HookRegistry.check_if_exists_or_initialize(module)
            for name in (_GROUP_OFFLOADING, _LAYER_EXECUTION_TRACKER, _LAZY_PREFETCH_GROUP_OFFLOADING):
                registry.remove_hook(name, recurse=True)
            _move(module, HOME)
        self.installed = False

    @staticmethod
    def _top_hook(module: torch.nn.Module) -> Any:
        registry = getattr(module, "_diffusers_hook", None)
        return None if registry is None else registry.get_hook("group_offloading")

    def groups(self) -> list[Any]:
        """The streamed block groups (diffusers ``ModuleGroup`` s), each once."""
        groups: dict[int, Any] = {}
        for module in self.modules.values():
            top = self._top_hook(module)
            for sub in module.modules():
                registry = getattr(sub, "_diffusers_hook", None)
                hook = None if registry is None else registry.get_hook("group_offloading")
                if hook is not None and hook is not top:
                    groups.setdefault(id(hook.group), hook.group)
        return list(groups.values())

    def resident_bytes(self) -> int:
        """Bytes of the denoiser layers that stay on the device (everything but the groups)."""
        streamed = {id(t) for g in self.groups() for m in g.modules for t in [*m.parameters(), *m.buffers()]}
        total = 0
        seen: set[int] = set()
        for module in self.modules.values():
            for t in [*module.parameters(), *module.buffers()]:
                if id(t) not in streamed and id(t) not in seen:
                    seen.add(id(t))
                    total += tensor_bytes(t)
        return total

    def max_group_bytes(self) -> int:
        """Bytes of the largest streamed group."""
        return max((module_tensor_bytes(g.modules) for g in self.groups()), default=0)

    def stats(self) -> dict[str, Any]:
        return {"groups": len(self.groups()), "blocks_per_group": self.blocks_per_group,
                "stream": self.use_stream}


class OffloadManager:
    """Where each component's weights are, and the moves each work stage needs.

    Args:
        adapter: the loaded adapter (its components may be on the CPU or the device).
        device: the compute device.
        cpu_offload: model CPU offload (see the module docstring).
        layerwise: layerwise offload of the denoiser(s).
        blocks_per_group: denoiser blocks per streamed group (``layerwise`` only).

    Without either mode every component is moved to the device once and stays there; `stage`
    then moves nothing.

    Threads: `stage` may be entered from the stepping thread and the prepare/decode thread at
    once; moves and bookkeeping are serialized, and a component in use is never evicted.
    """

    def __init__(self, adapter: "PipelineAdapter", device: torch.device, cpu_offload: bool = False,
                 layerwise: bool = False, blocks_per_group: int = 1):
        self.device = device
        self.cpu_offload = cpu_offload
        self.stages = stage_components(adapter)
        self.modules = {name: m for name, m in adapter.modules().items()}
        self.accepts_images = bool(getattr(adapter.spec, "accepts_images", False))
        denoisers = {name: self.modules[name] for name in self.stages["denoise"]}
        self.layerwise = LayerwiseOffload(denoisers, device, blocks_per_group) if layerwise else None
        #: components whose residency this manager decides (the rest are resident or layerwise)
        self.managed = [n for n in self.modules if cpu_offload and not (self.layerwise and n in denoisers)]
        self.bytes = {name: module_tensor_bytes([m]) for name, m in self.modules.items()}
        self.resident: set[str] = set()
        self.in_use: Counter[str] = Counter()
        self.loads = 0
        self.evictions = 0
        self.bytes_loaded = 0
        self._denoising: Callable[[], bool] = lambda: False
        self._lock = threading.RLock()
        self.attach()

    @property
    def mode(self) -> str:
        """``none``, ``model``, ``layerwise`` or ``model+layerwise``."""
        parts = (["model"] if self.cpu_offload else []) + (["layerwise"] if self.layerwise else [])
        return "+".join(parts) or "none"

    def fixed_components(self) -> list[str]:
        """Components that never move (neither model-offloaded nor layerwise)."""
        return [n for n in self.modules
                if n not in self.managed and not (self.layerwise and n in self.layerwise.modules)]

    def set_denoising(self, denoising: Callable[[], bool]) -> None:
        """`denoising()` says whether any request still has denoising steps to run (the
        denoiser is not evicted while it does)."""
        self._denoising = denoising

    # ------------------------------------------------------------------ placement
    def attach(self) -> None:
        """Place every component: managed ones at home on the CPU (moved in on demand),
        layerwise denoisers under their hooks, the rest on the device."""
        with self._lock:
            for name, module in self.modules.items():
                if name in self.managed:
                    _move(module, HOME)
                elif not (self.layerwise and name in self.layerwise.modules):
                    _move(module, self.device)
            self.resident = {n for n in self.modules if n not in self.managed}
            if self.layerwise is not None:
                self.layerwise.apply()

    def detach(self) -> None:
        """Remove the layerwise hooks (their weights go to the CPU) and forget what is
        resident, before the weights are put to sleep (`diffserve.memory.sleep`); no work may
        be running. Other weights stay where they are; `attach` places everything again.

        Raises:
            RuntimeError: a stage is in use.
        """
        with self._lock:
            if any(v > 0 for v in self.in_use.values()):
                raise RuntimeError(f"cannot detach while components are in use: {dict(self.in_use)}")
            if self.layerwise is not None:
                self.layerwise.remove()
            self.resident = set()

    def _needed(self, stage: str, with_images: bool) -> list[str]:
        names = list(self.stages[stage])
        if stage == "encode" and with_images:
            names += self.stages["decode"]
        return names

    def stage(self, stage: str, with_images: bool = False) -> contextlib.AbstractContextManager[int]:
        """Hold `stage`'s components on the device for one work item; the context gives how
        many components were moved in for it (0 when all were resident; without model offload
        a shared no-op context, nothing to do per step).

        Args:
            stage: ``encode``, ``denoise`` or ``decode``.
            with_images: an ``encode`` item with input images (the VAE encodes them).
        """
        if not self.managed:
            return _NOTHING_MOVED
        names = [n for n in self._needed(stage, with_images) if n in self.managed]
        return self._hold(names) if names else _NOTHING_MOVED

    @contextlib.contextmanager
    def _hold(self, names: list[str]) -> Iterator[int]:
        with self._lock:
            loads = self._ensure(names)
            self.in_use.update(names)
        try:
            yield loads
        finally:
            with self._lock:
                self.in_use.subtract(names)

    def _ensure(self, names: list[str]) -> int:
        missing = [n for n in names if n not in self.resident]
        if not missing:
            return 0
        pinned = self._denoising()
        for name in sorted(self.resident):
            if name in names or name not in self.managed or self.in_use[name] > 0:
                continue
            if pinned and name in self.stages["denoise"]:
                continue
            _move(self.modules[name], HOME)
            self.resident.discard(name)
            self.evictions += 1
        for name in missing:
            _move(self.modules[name], self.device)
            self.resident.add(name)
            self.loads += 1
            self.bytes_loaded += self.bytes[name]
        logger.debug("offload: loaded %s; resident %s", missing, sorted(self.resident))
        return len(missing)

    # ------------------------------------------------------------------ accounting
    def resident_weight_bytes(self) -> int:
        """Bytes of weights on the device now, not counting layerwise groups in flight (on a
        CPU device: every weight, since the device is the CPU)."""
        if self.device.type == "cpu":
            return sum(self.bytes.values())
        with self._lock:
            total = sum(self.bytes[n] for n in self.resident
                        if not (self.layerwise and n in self.layerwise.modules))
        if self.layerwise is not None:
            total += self.layerwise.resident_bytes()
        return total

    def peak_weight_bytes(self) -> int:
        """Most bytes of weights the policy ever holds on the device (for the memory budget):
        all weights without offload; denoiser + the larger other stage with model offload
        (encoders + VAE when image inputs are accepted); a layerwise denoiser counts its
        resident layers plus two groups (current and prefetched). On a CPU device every
        weight (the device is the CPU)."""
        if self.device.type == "cpu":
            return sum(self.bytes.values())

        def stage_bytes(stage: str) -> int:
            return sum(self.bytes[n] for n in self.stages[stage]
                       if not (self.layerwise and n in self.layerwise.modules))

        denoise = stage_bytes("denoise")
        if self.layerwise is not None:
            denoise += self.layerwise.resident_bytes() + 2 * self.layerwise.max_group_bytes()
        encode, decode = stage_bytes("encode"), stage_bytes("decode")
        if not self.cpu_offload:
            return denoise + encode + decode
        return denoise + max(encode + (decode if self.accepts_images else 0), decode)

    def stats(self) -> dict[str, Any]:
        """``mode``, ``loads`` / ``evictions`` (component moves in / out since load),
        ``bytes_loaded``, ``resident`` (components on the device), ``resident_weight_bytes``
        and, with layerwise offload, ``layerwise`` (groups, blocks per group, stream)."""
        with self._lock:
            out: dict[str, Any] = {"mode": self.mode, "loads": self.loads, "evictions": self.evictions,
                                   "bytes_loaded": self.bytes_loaded, "resident": sorted(self.resident)}
        out["resident_weight_bytes"] = self.resident_weight_bytes()
        if self.layerwise is not None:
            out["layerwise"] = self.layerwise.stats()
        return out
