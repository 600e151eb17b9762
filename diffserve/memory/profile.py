"""Activation memory profile of a loaded model, for memory-aware admission
(`diffserve.engine.memory_budget`).

Measured once, when an engine with ``max_memory`` asks for it (before any request runs):

- **denoiser rows**: a denoiser forward of the default request at the default resolution with
  1 and `COPIES` copies (r and `COPIES` x r rows), after an unmeasured warm-up forward; the
  difference per added row is the bytes per row, the rest is the forward's fixed part. The same
  at half the side length gives a second point, so the bytes per row are fitted as
  ``base + per_pixel x pixels`` (image tokens grow with pixels, text tokens do not; attention on
  CPU and CUDA uses memory-efficient SDPA kernels, linear in tokens). A row never counts less
  than its own denoiser inputs and output (computed exactly, also fitted over pixels): on a
  tiny model the measured part is mostly page-granular noise.
- **decode**: one VAE decode of one image at the default resolution, scaled by pixels.
- **encode**: one prompt encode, kept as a fixed reserve (one encode runs at a time).

Peaks come from `diffserve.memory.accounting.measure_peak`: the CUDA allocator's peak, or on CPU
the process RSS high-water mark above a trimmed baseline (see that module). Where neither can
be measured (CPU without /proc), rows count only their inputs and outputs (``method`` says so).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from diffserve.core.messages import MemoryProfile
from diffserve.pipelines.base import RequestState
from diffserve.memory.accounting import measure_peak, rss_bytes
from diffserve.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from diffserve.memory.offload import OffloadManager
    from diffserve.pipelines.base import PipelineAdapter
    from diffserve.core.sampling_params import RequestLimits

logger = logging.getLogger(__name__)

#: Copies of the default request in the larger measured forward.
COPIES = 4


def _tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def device_available_bytes(device: torch.device) -> int | None:
    """Memory the engine could use on `device`: CUDA free memory plus what torch already
    reserved; on CPU (Linux) ``MemAvailable`` plus this process's RSS. None if unknown."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device))
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 + (rss_bytes() or 0)
    except OSError:
        return None
    return None


def _half(side: int, factor: int) -> int:
    return max(factor, (side // 2) // factor * factor)


def measure_memory_profile(adapter: "PipelineAdapter", offload: "OffloadManager", limits: "RequestLimits",
                           device: torch.device) -> MemoryProfile:
    """Measure the profile described in the module docstring (a few forwards and one decode;
    runs under inference mode, with the prompt-embedding cache bypassed)."""
    spec = adapter.spec
    h0, w0 = spec.default_height, spec.default_width
    factor = spec.resolution_factor
    sizes = [(h0, w0)]
    if (_half(h0, factor), _half(w0, factor)) != (h0, w0):
        sizes.append((_half(h0, factor), _half(w0, factor)))
    frames = spec.default_num_frames or 1
    cache, adapter.prompt_embed_cache = adapter.prompt_embed_cache, None
    measured = True
    points: list[tuple[int, int, int]] = []
    floors: list[tuple[int, int]] = []
    fixed = 0
    encode_bytes = decode_per_pixel = 0.0
    try:
        with torch.inference_mode():
            for i, (h, w) in enumerate(sizes):
                params = SamplingParams(seed=0, num_inference_steps=1, output_type="np", height=h, width=w)
                params = params.resolve(spec, limits, 0)
                state = RequestState("memory-profile", "memory profile", params)
                with offload.stage("encode"):
                    peak = measure_peak(device, lambda: adapter.prepare(state))
                if i == 0:
                    encode_bytes = peak or 0
                rows = adapter.rows(params)
                with offload.stage("denoise"):
                    floor = _row_floor(adapter, state)
                    _forward(adapter, state, COPIES)  # warm-up: lazy init, kernel caches
                    p1 = measure_peak(device, lambda: _forward(adapter, state, 1))
                    pn = measure_peak(device, lambda: _forward(adapter, state, COPIES))
                floors.append((h * w * frames, floor))
                if p1 is None or pn is None:
                    measured = False
                    per_row, fixed_here = 0.0, 0
                else:
                    per_row = max((pn - p1) / ((COPIES - 1) * rows), 0.0)
                    fixed_here = max(int(p1 - max(per_row, floor) * rows), 0)
                fixed = max(fixed, fixed_here)
                points.append((h, w, int(per_row)))
                if i == 0:
                    with offload.stage("decode"):
                        latents = state.latents
                        d = measure_peak(device, lambda: adapter.decode(state, latents))
                    pixels = h * w * frames
                    decode_per_pixel = (d if d is not None else _tensor_bytes(latents) * 48) / (
                        pixels * params.num_images_per_prompt)
                state.release()
    finally:
        adapter.prompt_embed_cache = cache
    base, per_pixel = _fit([(h * w * frames, b) for h, w, b in points])
    floor_base, floor_per_pixel = _fit(floors)
    method = ("cuda allocator peak" if device.type == "cuda" else "process RSS high-water mark") if measured \
        else "inputs and outputs only (no peak measurement on this platform)"
    profile = MemoryProfile(
        weight_bytes=offload.peak_weight_bytes(),
        reserve_bytes=int(fixed + encode_bytes),
        row_bytes_base=base,
        row_bytes_per_pixel=per_pixel,
        decode_bytes_per_pixel=decode_per_pixel,
        row_floor_base=floor_base,
        row_floor_per_pixel=floor_per_pixel,
        frames=frames,
        points=tuple(points),
        method=method,
        device_available_bytes=device_available_bytes(device),
    )
    logger.info("memory profile: %s", profile)
    return profile


def _forward(adapter: "PipelineAdapter", state: "RequestState", copies: int) -> None:
    batch = adapter.collate([state] * copies)
    adapter.combine(batch, adapter.denoise(batch))


def _row_floor(adapter: "PipelineAdapter", state: "RequestState") -> int:
    """Bytes of one row's denoiser inputs plus its output row."""
    batch = adapter.collate([state])
    rows = max(batch.num_rows, 1)
    inputs = _tensor_bytes(batch.inputs)
    latent_row = _tensor_bytes(state.latents) // max(state.num_images, 1)
    return int(inputs / rows + latent_row)


def _fit(points: list[tuple[int, int]]) -> tuple[float, float]:
    """``(base, per_pixel)`` of bytes-per-row = base + per_pixel x pixels through the measured
    points (one point: proportional to pixels; a negative slope from noise: flat at the max)."""
    if len(points) == 1:
        pixels, value = points[0]
        return 0.0, value / pixels
    (p0, v0), (p1, v1) = points[0], points[1]
    slope = (v0 - v1) / (p0 - p1)
    if slope <= 0:
        return float(max(v0, v1)), 0.0
    return max(v0 - slope * p0, 0.0), slope
