"""Timing arms of a benchmark interleaved in one run (the house rule for speed numbers: arms
alternate order every repeat, so a noisy machine's slow spells fall on all of them; report the
median with [min, max], and ratios paired by repeat)."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence


def add_timing_arguments(ap: argparse.ArgumentParser, iters: int = 3, repeats: int = 5,
                         dtypes: Sequence[str] | None = ("fp32", "bf16", "fp16")) -> None:
    """The options every interleaved forward benchmark takes: ``--threads`` (torch threads),
    ``--repeats`` (rounds of `time_arms`, default `repeats`), ``--iters`` (calls per arm and
    round, default `iters`), ``--json``, and, unless `dtypes` is None, ``--device`` and
    ``--dtype`` (one of `dtypes`, default fp32)."""
    if dtypes is not None:
        ap.add_argument("--device", default="cpu")
        ap.add_argument("--dtype", default="fp32", choices=list(dtypes))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=repeats)
    ap.add_argument("--iters", type=int, default=iters)
    ap.add_argument("--json", action="store_true")


def device_sync(device: str) -> Callable[[], None]:
    """The `time_arms` ``sync`` for a device name: ``torch.cuda.synchronize`` on CUDA, nothing
    elsewhere."""
    if not device.startswith("cuda"):
        return lambda: None
    import torch

    return torch.cuda.synchronize


def time_arms(arm: Callable[[str], None], names: Sequence[str], repeats: int, iters: int,
              sync: Callable[[], None] = lambda: None) -> dict[str, list[float]]:
    """Milliseconds per call of `arm(name)` for each of `names`: one warm-up call each, then
    `repeats` rounds (forward order on even rounds, reversed on odd ones) of `iters` calls per
    arm, timed between `sync()` calls (e.g. ``torch.cuda.synchronize``). Returns {name: [ms per
    call, one per repeat]}."""
    for name in names:
        arm(name)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        for name in (names if r % 2 == 0 else list(names)[::-1]):
            sync()
            start = time.perf_counter()
            for _ in range(iters):
                arm(name)
            sync()
            times[name].append((time.perf_counter() - start) / iters * 1000)
    return times


def print_summary(result: dict[str, tuple[float, float, float]], ratios: dict[str, float], header: str,
                  extra: dict | None = None, as_json: bool = False) -> None:
    """Print `header`, each arm's median [min, max] ms, the ratios, and with `as_json` one JSON
    line ``{"ms", "ratios", **extra}``."""
    import json

    print(header)
    for name, (med, lo, hi) in result.items():
        print(f"  {name:9s} {med:8.2f} ms [{lo:.2f}, {hi:.2f}]")
    print("  " + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items()))
    if as_json:
        print(json.dumps({"ms": result, "ratios": ratios, **(extra or {})}))


def summarize(times: dict[str, list[float]], subject: str) -> tuple[dict[str, tuple[float, float, float]],
                                                                    dict[str, float]]:
    """(median, min, max) ms per arm, and `subject`'s time over each other arm's as the median
    of the per-repeat ratios (keys ``"subject/other"``)."""
    result = {n: (statistics.median(v), min(v), max(v)) for n, v in times.items()}
    ratios = {f"{subject}/{n}": statistics.median(m / o for m, o in zip(times[subject], v))
              for n, v in times.items() if n != subject}
    return result, ratios
