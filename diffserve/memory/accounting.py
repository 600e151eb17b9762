"""Memory accounting of the device a runner uses: the process-wide peak, the bytes of module
weights, and measurement windows (the peak reached while a piece of work ran).

What "memory" means per device:

- CUDA: the caching allocator's counters (``torch.cuda.max_memory_allocated``), exact to the
  byte for tensors.
- CPU: the device memory IS the process's memory, and torch keeps no allocator statistics
  for it, so the measure is the process's resident set size (RSS). A window resets the
  kernel's RSS high-water mark (``/proc/self/clear_refs``, Linux >= 4.0) at its start and reads
  it (``VmHWM``) at its end: the highest RSS the whole process reached meanwhile (other
  threads' allocations included, page-granular). Freed memory the C allocator keeps for reuse
  still counts as resident, so `release_host_memory` (glibc ``malloc_trim``) runs before a
  measurement that must see fresh growth (`measure_peak`). Without ``/proc`` (not Linux),
  windows report None. The reset takes the process's memory-map write lock, which waits for
  every thread's page faults in flight: ~25 us typically, but milliseconds on a busy machine;
  so denoising-step windows reset it at most every `STEP_RESET_INTERVAL_S` (``min_reset_interval_s``)
  and a step's peak then covers the earlier steps since the last reset too (an upper bound). Reading
  it right after a denoiser forward costs ~40-80 us (7 us otherwise), so step windows may skip the
  read (``read=False``, see `ModelMemory.window`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import resource
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from diffserve.core.tensor_storage import tensor_bytes

_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"
#: Highest peak seen before a window reset the device's peak counter, per device string
#: (a reset must not make `peak_memory_bytes` forget the process's real peak).
_seen_peak: dict[str, int] = {}
_lock = threading.Lock()
_hwm_reset_works: bool | None = None
_libc: Any = None
#: (pid, status fd, clear_refs fd): kept open (a window costs ~25 us instead of ~150 us),
#: reopened in a forked child (its /proc/self is another process).
_fds: tuple[int, int, int] | None = None
#: perf_counter() of the last RSS high-water-mark reset (see `PeakWindow.min_reset_interval_s`).
_last_reset_s = float("-inf")
#: Seconds between two high-water-mark resets of denoising-step windows on CPU.
STEP_RESET_INTERVAL_S = 0.25


def _proc_fds() -> tuple[int, int]:
    global _fds
    pid = os.getpid()
    if _fds is None or _fds[0] != pid:
        _fds = (pid, os.open(_STATUS, os.O_RDONLY), os.open(_CLEAR_REFS, os.O_WRONLY))
    return _fds[1], _fds[2]


def _proc_status(*keys: str) -> dict[str, int]:
    """Fields of /proc/self/status in bytes (those given in kB); missing keys are left out."""
    out: dict[str, int] = {}
    text = b"\n" + os.pread(_proc_fds()[0], 8192, 0)
    for key in keys:
        at = text.find(b"\n" + key.encode() + b":")
        if at >= 0:
            out[key] = int(text[at + len(key) + 2: text.index(b"\n", at + 1)].split()[0]) * 1024
    return out


def rss_bytes() -> int | None:
    """The process's current resident set size in bytes (None where /proc is unavailable)."""
    try:
        return _proc_status("VmRSS")["VmRSS"]
    except (OSError, KeyError, ValueError):
        return None


def _maxrss_bytes() -> int:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def _reset_hwm() -> bool:
    """Reset the kernel's RSS high-water mark to the current RSS; False if not possible.
    The peak so far is kept first (``ru_maxrss``: the high-water mark, or a higher earlier
    peak recorded when a thread exited; either is a real peak of the process)."""
    global _hwm_reset_works, _last_reset_s
    if _hwm_reset_works is False:
        return False
    try:
        peak = _maxrss_bytes()
        with _lock:
            _seen_peak["cpu"] = max(_seen_peak.get("cpu", 0), peak)
        os.write(_proc_fds()[1], b"5")
        _hwm_reset_works = True
        _last_reset_s = time.perf_counter()
    except (OSError, ValueError):
        _hwm_reset_works = False
    return _hwm_reset_works


def release_host_memory() -> None:
    """Hand freed heap memory back to the OS (glibc ``malloc_trim(0)``, ~50 us; a no-op
    elsewhere), so the RSS reflects live data only. (No full garbage collection: tensors are
    freed by reference counting, and a full collection takes ~1 s in a process that imported
    diffusers.)"""
    global _libc
    if not sys.platform.startswith("linux"):
        return
    if _libc is None:
        try:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _libc.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):
            _libc = False
    if _libc:
        _libc.malloc_trim(0)


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA allocator peak (bytes) on a GPU; the process's peak resident set size (bytes) on
    CPU (``ru_maxrss``: KiB on Linux, bytes on macOS), over the whole process lifetime (also
    across the resets measurement windows make)."""
    if device.type == "cuda":
        return max(int(torch.cuda.max_memory_allocated(device)), _seen_peak.get(str(device), 0))
    return max(_maxrss_bytes(), _seen_peak.get("cpu", 0))


def module_tensor_bytes(modules: Iterable[torch.nn.Module], device: torch.device | None = None) -> int:
    """Bytes of the parameters and buffers of `modules` (each tensor once), optionally only
    those on `device` (compared by type and index). Quantized weights (tensor subclasses) count
    their real storage (`diffserve.core.tensor_storage.tensor_bytes`), not their logical size."""
    seen: set[int] = set()
    total = 0
    for module in modules:
        for t in [*module.parameters(), *module.buffers()]:
            if id(t) in seen:
                continue
            seen.add(id(t))
            if device is None or _same_device(t.device, device):
                total += tensor_bytes(t)
    return total


def _same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    if a.type != "cuda":
        return True
    return (a.index or torch.cuda.current_device()) == (b.index if b.index is not None else torch.cuda.current_device())


class PeakWindow:
    """Measures the peak memory reached while a block of code runs (see the module docstring
    for what that is per device). Costs ~25 us on CPU (Linux), ~1 us on CUDA.

    Args:
        device: the device measured.
        measure_start: also read the bytes in use at the start (always done on CUDA).
        min_reset_interval_s: CPU only: skip the high-water-mark reset when the last one was
            less than this many seconds ago (the peak then also covers the time since it).
        read: CPU only: False skips reading the high-water mark at the end unless this window
            reset it (``skipped`` is then True and ``peak`` None): the read right after a
            denoiser forward costs ~40-80 us, 1-2 % of a small step.

    Usage::

        with PeakWindow(device) as window:
            run()
        window.peak   # absolute peak bytes during the block (None if not measurable)
        window.start  # bytes in use when the block began (None if not read)
    """

    def __init__(self, device: torch.device, measure_start: bool = False, min_reset_interval_s: float = 0.0,
                 read: bool = True):
        self.device = device
        self.measure_start = measure_start
        self.min_reset_interval_s = min_reset_interval_s
        self.read = read
        self.start: int | None = None
        self.peak: int | None = None
        self.skipped = False
        self._active = False
        self._reset = False

    def __enter__(self) -> "PeakWindow":
        if self.device.type == "cuda":
            key = str(self.device)
            with _lock:
                _seen_peak[key] = max(_seen_peak.get(key, 0), int(torch.cuda.max_memory_allocated(self.device)))
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start = int(torch.cuda.memory_allocated(self.device))
            self._active = True
        elif _hwm_reset_works and time.perf_counter() - _last_reset_s < self.min_reset_interval_s:
            self._active = True
        elif _reset_hwm():
            self._active = self._reset = True
        if self._active and self.measure_start and self.device.type != "cuda":
            self.start = rss_bytes()
        return self

    def __exit__(self, *exc) -> None:
        if not self._active:
            return
        if self.device.type == "cuda":
            self.peak = int(torch.cuda.max_memory_allocated(self.device))
            return
        if not self.read and not self._reset:
            self.skipped = True
            return
        try:
            self.peak = _proc_status("VmHWM")["VmHWM"]
        except (OSError, KeyError, ValueError):
            self.peak = None


def measure_peak(device: torch.device, fn: Callable[[], Any]) -> int | None:
    """Bytes that running `fn()` added at its peak over what was in use before it (CUDA:
    allocator-exact; CPU: RSS high-water above the RSS after `release_host_memory`), or None
    where it cannot be measured. Synchronizes a CUDA device before and after."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    else:
        release_host_memory()
    with PeakWindow(device, measure_start=True) as window:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    if window.peak is None or window.start is None:
        return None
    return max(0, window.peak - window.start)
