"""Memory accounting of the device a runner uses."""

from __future__ import annotations

import resource
import sys

import torch


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA allocator peak (bytes) on a GPU; the process's peak resident set size (bytes) on
    CPU (``ru_maxrss``: KiB on Linux, bytes on macOS)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)
