"""Regional ``torch.compile``: compile the denoiser's repeated blocks (and optionally the VAE
decoder) instead of the whole model.

Regional compilation (PyTorch recipe "regional_compilation"; diffusers'
``ModelMixin.compile_repeated_blocks``) compiles one transformer block class once and reuses
the code for every instance, so cold compiles take seconds, not minutes. Blocks are compiled
with ``dynamic=True`` so batch size (rows) and image-token count are symbolic: a mixed batch
size does not recompile (torch still specializes size 1, so rows == 1 gets its own graph).
Duck shaping is turned off (`disable_duck_shaping`): by default dynamo gives dimensions that
happen to be equal at compile time ONE symbol, so a warm-up whose token count equals a channel
count (the tiny SDXL UNet at 64 px: 16 tokens, 16 channels) builds a graph guarded on that
equality, and every other resolution recompiled.

Compilation is lazy, so failures (no C compiler, an unsupported op) surface on the first
call: `RegionalCompiler.warm_up` runs those calls at startup and, if one fails, restores eager
execution with a warning instead of failing the engine. Both steps log (INFO, logger
``diffserve.acceleration.compile``): what is compiled (block classes and counts, the VAE
decoder, backend, dynamic shapes) before the warm-up, then how long it took and how many graphs
it built, so a start-up that spends tens of seconds compiling says so.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger(__name__)

#: ``torch.compile`` backend (a name or a callable; tests swap in a failing one).
COMPILE_BACKEND: Any = "inductor"

def disable_duck_shaping() -> None:
    """Give every dynamic dimension its own symbol, even where sizes coincide at compile time
    (process-wide torch setting ``torch.fx.experimental._config.use_duck_shape``; a no-op on a
    torch without it)."""
    from torch.fx.experimental import _config

    if hasattr(_config, "use_duck_shape"):
        _config.use_duck_shape = False


def _graphs_compiled() -> int:
    """Dynamo graphs compiled so far in this process (compiles + recompiles, all models)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class RegionalCompiler:
    """Compiles a denoiser's repeated blocks (and optionally a VAE decoder) in place.

    Args:
        denoiser: a diffusers ``ModelMixin`` (the transformer).
        repeated_blocks: class names of its repeated blocks (the adapter's capability; the
            diffusers class's ``_repeated_blocks`` when empty).
        vae_decoder: module to compile too (e.g. ``vae.decoder``), or None.
        dynamic: ``torch.compile(dynamic=...)``; True avoids per-batch-size recompiles.

    Attributes:
        active: compiled code is in use (False after a fallback to eager).
        fallback_reason: the error that caused the fallback, or None.
    """

    def __init__(self, denoiser: torch.nn.Module, repeated_blocks: tuple[str, ...] = (),
                 vae_decoder: torch.nn.Module | None = None, dynamic: bool = True):
        self.denoiser = denoiser
        self.repeated_blocks = tuple(repeated_blocks) or tuple(getattr(denoiser, "_repeated_blocks", None) or ())
        self.vae_decoder = vae_decoder
        self.dynamic = dynamic
        self.active = False
        self.fallback_reason: str | None = None
        self.warmup_s = 0.0
        self._modules: list[torch.nn.Module] = []
        self._graphs_at_start = 0
        self._graphs_after_warmup: int | None = None

    def apply(self) -> None:
        """Mark the repeated blocks (and the VAE decoder) for compilation; falls back to
        eager (with a warning) if that already raises."""
        self._graphs_at_start = _graphs_compiled()
        try:
            if not self.repeated_blocks:
                raise ValueError(f"no repeated blocks known for {type(self.denoiser).__name__}")
            if self.dynamic:
                disable_duck_shaping()
            names = set(self.repeated_blocks)
            targets = [m for m in self.denoiser.modules() if type(m).__name__ in names]
            if self.vae_decoder is not None:
                targets.append(self.vae_decoder)
            for module in targets:
                module.compile(backend=COMPILE_BACKEND, dynamic=self.dynamic)
                self._modules.append(module)
            self.active = True
            logger.info("torch.compile (backend %s, %s shapes): %s of %s%s; compiling while warming up",
                        getattr(COMPILE_BACKEND, "__name__", COMPILE_BACKEND),
                        "dynamic" if self.dynamic else "static", self.describe_targets(targets),
                        type(self.denoiser).__name__, " and its VAE decoder" if self.vae_decoder is not None else "")
        except Exception as exc:  # noqa: BLE001 - compile is an optimisation, never fatal
            self.fall_back(exc)

    def warm_up(self, calls: list[Callable[[], Any]]) -> None:
        """Run `calls` (forwards at the configured batch sizes) so every graph is compiled
        before the first request; on any error restore eager execution (with a warning)."""
        if not self.active:
            return
        start = time.perf_counter()
        try:
            for call in calls:
                call()
        except Exception as exc:  # noqa: BLE001
            self.fall_back(exc)
        self.warmup_s = time.perf_counter() - start
        self._graphs_after_warmup = _graphs_compiled()
        if self.active:
            logger.info("torch.compile: warm-up of %d forward(s) took %.1f s (%d graph(s) compiled)", len(calls),
                        self.warmup_s, self._graphs_after_warmup - self._graphs_at_start)

    def describe_targets(self, targets: list[torch.nn.Module]) -> str:
        """``"24 x JointTransformerBlock"`` style counts of the block classes among `targets`."""
        counts: dict[str, int] = {}
        for module in targets:
            if module is not self.vae_decoder:
                counts[type(module).__name__] = counts.get(type(module).__name__, 0) + 1
        return ", ".join(f"{n} x {name}" for name, n in counts.items()) or "no blocks"

    def fall_back(self, exc: BaseException) -> None:
        """Undo compilation: every module runs eagerly again."""
        for module in self._modules:
            module._compiled_call_impl = None
        self._modules = []
        self.active = False
        self.fallback_reason = f"{type(exc).__name__}: {exc}"
        logger.warning("torch.compile failed, running eagerly: %s", self.fallback_reason)

    def stats(self) -> dict[str, Any]:
        """``enabled`` (compiled code in use), ``fallback_reason``, ``warmup_s`` (seconds),
        ``graphs_compiled`` (dynamo graphs since `apply`, process-wide) and
        ``recompiles_after_warmup`` (graphs compiled after warm-up: each one is a recompile a
        request paid for)."""
        now = _graphs_compiled()
        after = self._graphs_after_warmup
        return {
            "enabled": self.active,
            "fallback_reason": self.fallback_reason,
            "warmup_s": self.warmup_s,
            "graphs_compiled": now - self._graphs_at_start,
            "recompiles_after_warmup": 0 if after is None else now - after,
        }
