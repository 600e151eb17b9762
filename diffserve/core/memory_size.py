"""Memory sizes as users write them (``24GiB``, ``512MB``, ``auto``) and as diffserve prints
them; torch-free, so the CLI checks ``--max-memory`` before any heavy import."""

from __future__ import annotations

import math
import re
from typing import Any

from diffserve.core.errors import InvalidRequestError

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?(?:e[0-9]+)?)\s*([a-z]*)\s*$")
_ALLOWED = "a number of bytes >= 1, a size such as '24GiB' or '512MB', or 'auto' (the device's free memory)"


def parse_memory(value: Any) -> int | str | None:
    """``EngineConfig.max_memory`` as bytes, ``"auto"`` or None.

    Raises:
        InvalidRequestError: not a positive finite size (field ``max_memory``), e.g. ``0``,
            ``"12XB"`` or ``"1e400"`` (overflows a float).
    """
    if value is None:
        return None
    if isinstance(value, bool):
        raise InvalidRequestError("max_memory", value, _ALLOWED)
    if isinstance(value, (int, float)):
        if math.isfinite(value) and value >= 1:
            return int(value)
        raise InvalidRequestError("max_memory", value, _ALLOWED)
    if isinstance(value, str):
        text = value.strip().lower()
        if text == "auto":
            return "auto"
        match = _SIZE.match(text)
        if match and match.group(2) in _UNITS:
            scaled = float(match.group(1)) * _UNITS[match.group(2)]
            if math.isfinite(scaled) and scaled >= 1:
                return int(scaled)
    raise InvalidRequestError("max_memory", value, _ALLOWED)


def format_bytes(n: float) -> str:
    """``n`` bytes as a short human-readable size (``"1.50 GiB"``)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"
