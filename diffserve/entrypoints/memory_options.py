"""Command-line options for memory: offload, memory-aware admission, sleep mode.

Engine options (``generate`` and ``serve``)::

    --cpu-offload            model CPU offload, serving-aware (components move to the device
                             for their stage; the denoiser stays while requests denoise)
    --layerwise-offload      stream the denoiser's blocks to the device during each forward
    --offload-blocks N       blocks per streamed group with --layerwise-offload (default 1)
    --max-memory SIZE        device memory budget for admission: bytes, 24GiB, 512MB or auto
    --enable-sleep-mode      pack weights into the sleep pool so sleep frees exactly them

Server options (``serve``)::

    --wake-on-request        a generation request wakes a sleeping engine instead of a 503

See `diffserve.memory.offload`, `diffserve.engine.memory_budget` and
`diffserve.memory.sleep`.
"""

from __future__ import annotations

import argparse
from typing import Any


def add_memory_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the engine's memory options to `parser`."""
    group = parser.add_argument_group("memory")
    group.add_argument("--cpu-offload", action="store_true",
                       help="keep components on the CPU and move each to the device for its stage "
                            "(the denoiser stays while requests denoise)")
    group.add_argument("--layerwise-offload", action="store_true",
                       help="stream the denoiser's blocks to the device group by group during each forward")
    group.add_argument("--offload-blocks", type=int, default=1, metavar="N",
                       help="denoiser blocks per streamed group with --layerwise-offload (default 1)")
    group.add_argument("--max-memory", default=None, metavar="SIZE",
                       help="device memory budget for admission: bytes, a size such as 24GiB or 512MB, or "
                            "auto (the device's free memory); requests that alone exceed it are refused")
    group.add_argument("--enable-sleep-mode", action="store_true",
                       help="pack weights into one block per component so sleep frees exactly their memory")


def memory_config(args: argparse.Namespace) -> dict[str, Any]:
    """The `EngineConfig` fields of the memory options in `args`."""
    return {"cpu_offload": args.cpu_offload, "layerwise_offload": args.layerwise_offload,
            "offload_blocks": args.offload_blocks, "max_memory": args.max_memory,
            "enable_sleep_mode": args.enable_sleep_mode}


def add_sleep_server_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the server's sleep-mode options to `parser` (read by
    `diffserve.entrypoints.openai.ops.sleep.install_sleep_routes`)."""
    parser.add_argument("--wake-on-request", action="store_true",
                        help="while the engine sleeps (POST /sleep), a generation request wakes it instead "
                             "of getting 503 + Retry-After")
