"""The engine's LoRA adapters (plain data, no torch): which names exist and where their files
are (`LoraRegistry`), and their loads into the workers beside the steps (`EngineLoras`).

Names come from four places: adapters loaded at startup (``--lora NAME=PATH``) or through the
API (`DiffusionEngine.load_lora`, ``POST /v1/loras``), files or folders in ``--lora-dir``
(``DIR/NAME.safetensors`` or ``DIR/NAME/``, registered the first time a request names them),
and the built-in model's own adapters (e.g. ``mirror`` of ``digits``). A request naming a
registered adapter that the workers do not hold yet waits in the queue while it loads beside the
steps; a load failure fails the requests waiting for it.

Workers keep at most ``max_cpu_loras`` adapters in host memory: loading one more drops the
least recently used adapter no request holds (it reloads from its path when named again).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from diffserve.core.errors import InvalidRequestError, LoraInUseError, UnknownLoraError

logger = logging.getLogger(__name__)

#: What a LoRA name may look like (a file stem: letters, digits, ``._-``; no path separators).
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class LoraState(str, Enum):
    """Where an adapter is: known (its path) but not in the workers, being read, ready to
    use, or failed to load (the error is kept; loading it again retries)."""

    REGISTERED = "registered"
    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"


@dataclass
class LoraEntry:
    """One named adapter.

    Attributes:
        origin: ``"startup"``, ``"api"``, ``"lora_dir"`` or ``"builtin"``.
        info: the workers' summary once read (format, rank, modules per component, bytes).
        last_used: ``time.monotonic()`` of its last use by a request (LRU of host copies).
    """

    name: str
    path: str
    origin: str
    state: LoraState = LoraState.REGISTERED
    error: str | None = None
    info: dict[str, Any] = field(default_factory=dict)
    last_used: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        """Plain data for listings (``GET /v1/loras``, ``list_loras``)."""
        return {"name": self.name, "path": self.path, "origin": self.origin, "state": self.state.value,
                "error": self.error, **{k: v for k, v in self.info.items() if k not in ("name", "source")}}


def check_name(name: Any, field_name: str = "name") -> str:
    """`name` if it is a valid LoRA name.

    Raises:
        InvalidRequestError: naming `field_name`.
    """
    if not isinstance(name, str) or not NAME_PATTERN.match(name):
        raise InvalidRequestError(field_name, name, "a LoRA name of 1-128 letters, digits, '.', '_' or '-' "
                                  "(starting with a letter or digit)")
    return name


class LoraRegistry:
    """Names, paths and load states of the engine's adapters.

    Args:
        lora_dir: folder whose files / sub-folders load on first use (None: none).
        builtin: the served model's own adapters, name -> path.
        max_loras: device slots of the workers (most distinct adapters among running requests).
        max_cpu_loras: most adapters the workers hold in host memory.
    """

    def __init__(self, lora_dir: str | Path | None, builtin: Mapping[str, str | Path], max_loras: int,
                 max_cpu_loras: int):
        self.lora_dir = Path(lora_dir).resolve() if lora_dir is not None else None
        self.max_loras = max_loras
        self.max_cpu_loras = max(max_cpu_loras, max_loras)
        self.entries: dict[str, LoraEntry] = {}
        for name, path in builtin.items():
            self.entries[name] = LoraEntry(name, str(path), "builtin")

    # ------------------------------------------------------------------ names
    def get(self, name: str) -> LoraEntry | None:
        """The entry of `name`: registered, or found in ``lora_dir`` (then registered)."""
        entry = self.entries.get(name)
        if entry is None and self.lora_dir is not None and NAME_PATTERN.match(name):
            for candidate in (self.lora_dir / f"{name}.safetensors", self.lora_dir / name):
                if candidate.exists():
                    entry = self.entries[name] = LoraEntry(name, str(candidate), "lora_dir")
                    break
        return entry

    def check_request(self, loras: Mapping[str, float] | None) -> list[LoraEntry]:
        """The entries a request's ``loras`` names (registering ``lora_dir`` ones).

        Raises:
            UnknownLoraError: (field ``loras``) an unknown name.
            InvalidRequestError: (field ``loras``) more adapters than the workers have slots.
        """
        if not loras:
            return []
        entries = []
        for name in loras:  # unknown names first: a missing resource (404 over HTTP) before a count
            entry = self.get(name)
            if entry is None:
                raise UnknownLoraError("loras", dict(loras), f"names of loaded LoRA adapters ({self.known()})",
                                       detail=f"unknown LoRA {name!r}")
            entries.append(entry)
        if len(loras) > self.max_loras:
            raise InvalidRequestError("loras", dict(loras), f"at most {self.max_loras} LoRA adapters per request "
                                      "(--max-loras)")
        return entries

    def known(self) -> str:
        """The registered names (for messages), plus where more may come from."""
        names = ", ".join(sorted(self.entries)) or "none loaded"
        return names + (f"; or a file in {self.lora_dir}" if self.lora_dir is not None else "")

    def register(self, name: str, path: str | Path, origin: str) -> LoraEntry:
        """Register (or re-point) `name` to `path`; its state starts over."""
        check_name(name)
        entry = self.entries[name] = LoraEntry(name, str(path), origin)
        return entry

    def remove(self, name: str) -> LoraEntry | None:
        return self.entries.pop(name, None)

    def inside_lora_dir(self, path: Any) -> Path:
        """`path` (relative to ``lora_dir`` or absolute) resolved, if it lies inside
        ``lora_dir`` (what ``POST /v1/loras`` may load).

        Raises:
            InvalidRequestError: (field ``path``) no ``lora_dir`` is configured, or the path
                leaves it.
        """
        if self.lora_dir is None:
            raise InvalidRequestError("path", path, "a path inside --lora-dir (the server has no --lora-dir: "
                                      "adapters load only at startup)")
        if not isinstance(path, str) or not path or "\x00" in path:
            raise InvalidRequestError("path", path, f"a path inside {self.lora_dir}")
        resolved = (self.lora_dir / path).resolve()
        if not resolved.is_relative_to(self.lora_dir):
            raise InvalidRequestError("path", path, f"a path inside {self.lora_dir}")
        return resolved

    # ------------------------------------------------------------------ states
    def ready(self, names: Iterable[str]) -> bool:
        return all(self.entries[n].state is LoraState.READY for n in names if n in self.entries)

    def to_load(self, names: Iterable[str]) -> list[LoraEntry]:
        """Entries of `names` the workers do not hold and are not reading (registered, or
        failed before: a new request retries)."""
        return [self.entries[n] for n in names
                if n in self.entries and self.entries[n].state in (LoraState.REGISTERED, LoraState.FAILED)]

    def touch(self, names: Iterable[str]) -> None:
        now = time.monotonic()
        for n in names:
            if n in self.entries:
                self.entries[n].last_used = now

    def evictable(self, in_use: set[str]) -> list[LoraEntry]:
        """Ready adapters beyond ``max_cpu_loras`` to drop from the workers' host memory: the
        least recently used ones no request holds (those with a path to reload from)."""
        ready = [e for e in self.entries.values() if e.state in (LoraState.READY, LoraState.LOADING)]
        excess = len(ready) - self.max_cpu_loras
        if excess <= 0:
            return []
        candidates = sorted((e for e in ready if e.state is LoraState.READY and e.name not in in_use),
                            key=lambda e: e.last_used)
        return candidates[:excess]

    def listing(self) -> list[dict[str, Any]]:
        """Every entry as plain data, by name (``lora_dir`` files not yet named by a request
        are not listed)."""
        return [self.entries[n].as_dict() for n in sorted(self.entries)]


class EngineLoras:
    """The engine's side of LoRA adapters: the registry, loads in flight in the workers, and
    the admission rule. Called with the engine's lock held, except the blocking `load`.

    Args:
        registry: names and paths.
        executor: ``submit_load_lora`` / ``unload_lora`` reach the workers.
    """

    def __init__(self, registry: LoraRegistry, executor: Any):
        self.registry = registry
        self.executor = executor
        self._loads: dict[str, Future] = {}
        #: names the workers hold (READY): more than the host budget triggers eviction
        self._held: set[str] = set()

    # ------------------------------------------------------------------ requests
    def check(self, loras: Mapping[str, float] | None) -> None:
        """Validate a request's adapters and start loading those the workers do not hold.

        Raises:
            InvalidRequestError: (field ``loras``) an unknown name or too many adapters.
        """
        entries = self.registry.check_request(loras)
        self.registry.touch(e.name for e in entries)
        for entry in entries:
            if entry.state in (LoraState.REGISTERED, LoraState.FAILED):
                self._start(entry)

    def ready(self, names: Iterable[str]) -> bool:
        """Whether the workers hold every adapter of `names` (a request may be admitted)."""
        return self.registry.ready(names)

    def _start(self, entry: LoraEntry) -> None:
        entry.state, entry.error = LoraState.LOADING, None
        self._loads[entry.name] = self.executor.submit_load_lora(entry.name, entry.path)

    def in_flight(self) -> list[Future]:
        return list(self._loads.values())

    def needs_poll(self) -> bool:
        """Whether `poll` has anything to do: loads in flight, or more adapters held than the
        host budget (cheap: checked every step)."""
        return bool(self._loads) or len(self._held) > self.registry.max_cpu_loras

    def poll(self, in_use: set[str]) -> dict[str, str]:
        """Apply finished loads (non-blocking); drop least recently used adapters beyond the
        host budget that no request (`in_use`) names. Returns ``{name: error}`` of the loads
        that failed (the requests waiting for them fail)."""
        failed: dict[str, str] = {}
        done = [(n, f) for n, f in self._loads.items() if f.done()]
        for name, future in done:
            del self._loads[name]
            entry = self.registry.entries.get(name)
            if entry is None:
                continue
            try:
                entry.info = future.result()
                entry.state = LoraState.READY
                self._held.add(name)
            except Exception as exc:  # noqa: BLE001 - the load's own failure
                entry.state, entry.error = LoraState.FAILED, f"{type(exc).__name__}: {exc}"
                failed[name] = entry.error
                logger.error("loading LoRA %r from %s failed: %s", name, entry.path, entry.error)
        if len(self._held) > self.registry.max_cpu_loras:
            self._evict(in_use)
        return failed

    def _evict(self, in_use: set[str]) -> None:
        for entry in self.registry.evictable(in_use):
            try:
                self.executor.unload_lora(entry.name)
            except Exception as exc:  # noqa: BLE001 - kept: it stays usable
                logger.warning("could not drop LoRA %r from host memory: %s", entry.name, exc)
                continue
            entry.state = LoraState.REGISTERED
            self._held.discard(entry.name)

    # ------------------------------------------------------------------ API
    def begin_load(self, name: str, path: str | Path, origin: str, in_use: set[str]) -> Future:
        """Register `name` -> `path` and start reading it into the workers (replacing an
        adapter of that name no request names).

        Raises:
            InvalidRequestError: a bad name.
            LoraInUseError: requests name the adapter it would replace, or it is loading.
        """
        check_name(name)
        if name in in_use:
            raise LoraInUseError(f"LoRA {name!r} is used by waiting or running requests; load it under "
                                 "another name, or when they finish")
        if name in self._loads:
            raise LoraInUseError(f"LoRA {name!r} is being loaded; retry when it is ready")
        entry = self.registry.register(name, path, origin)
        self._held.discard(name)
        self._start(entry)
        return self._loads[name]

    def keep_after_failed_load(self, name: str, previous: LoraEntry | None) -> None:
        """After `begin_load` of `name` failed (its error was raised to the caller): put back
        the adapter it was to replace, which the workers still hold (a failed read replaces
        nothing), or forget the name, so a refused load leaves no trace."""
        if previous is None:
            self.registry.remove(name)
            return
        self.registry.entries[name] = previous
        if previous.state is LoraState.READY:
            self._held.add(name)

    def unload(self, name: str, in_use: set[str]) -> None:
        """Drop adapter `name` from the workers and the registry.

        Raises:
            InvalidRequestError: (field ``name``) no such adapter.
            LoraInUseError: requests name it, or it is loading.
        """
        entry = self.registry.entries.get(name)
        if entry is None:
            raise InvalidRequestError("name", name, f"the name of a loaded LoRA adapter ({self.registry.known()})")
        if name in in_use:
            raise LoraInUseError(f"LoRA {name!r} is used by waiting or running requests; unload it when they "
                                 "finish")
        if name in self._loads:
            raise LoraInUseError(f"LoRA {name!r} is being loaded; retry when it is ready")
        if entry.state is LoraState.READY:
            self.executor.unload_lora(name)
        self.registry.remove(name)
        self._held.discard(name)
