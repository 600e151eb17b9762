"""`LoraRegistry`: the engine's view of LoRA adapters (plain data, no torch): which names exist,
where their files are, whether the workers hold them (loading, ready, failed), and which
requests may run given the workers' device slots.

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

import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from diffserve.errors import InvalidRequestError

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
            InvalidRequestError: (field ``loras``) an unknown name, or more adapters than the
                workers have slots.
        """
        if not loras:
            return []
        if len(loras) > self.max_loras:
            raise InvalidRequestError("loras", dict(loras), f"at most {self.max_loras} LoRA adapters per request "
                                      "(--max-loras)")
        entries = []
        for name in loras:
            entry = self.get(name)
            if entry is None:
                raise InvalidRequestError("loras", dict(loras), f"names of loaded LoRA adapters ({self.known()})",
                                          detail=f"unknown LoRA {name!r}")
            entries.append(entry)
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
