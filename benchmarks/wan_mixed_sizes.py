"""One Wan transformer forward over rows of different sizes and frame counts
(`diffserve.pipelines.wan.mixed_sizes`) vs the alternatives, on the same rows, interleaved per
repeat:

- ``grouped``: one forward, each row's latents zero-padded at the end of frames, height and
  width to the largest grid, every block run once per (size, frames) on its real tokens only
  (length groups: what diffserve runs in eager forwards);
- ``padded``: the same forward with every block over the padded grid, padded keys masked in
  self-attention (``--no-length-groups``, and what compiled blocks / CUDA graphs run);
- ``uniform``: one stock forward of the same number of rows at that padded grid (the padded
  shape's floor: ``padded / uniform`` is what the mask costs);
- ``per_size``: one stock forward per (size, frames) (what batching by size runs).

A random-weight `WanTransformer3DModel` (no download): ``--layers`` blocks of width ``--heads`` x
``--head-dim`` (Wan's patch (1, 2, 2), 16 latent channels), or the ``transformer`` of a Wan
folder (``--model DIR``). Latents are 8x spatial, 4x temporal (F = 4k + 1 frames).

Usage::

    python benchmarks/wan_mixed_sizes.py                 # built-in mix, 1 thread
    python benchmarks/wan_mixed_sizes.py --mix 480x832x81:1,480x832x33:2 --device cuda --dtype bf16

Prints, per arm, the median and [min, max] ms per forward and the ratios.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from diffusers import WanTransformer3DModel

from diffserve.pipelines.row_data import RowData, forward_rows
from diffserve.pipelines.token_spans import LATENT_SIZE
from diffserve.pipelines.wan.mixed_sizes import install_token_spans
from interleaved_arms import add_timing_arguments, device_sync, print_summary, summarize, time_arms  # benchmarks/interleaved_arms.py (same folder)

SPATIAL, TEMPORAL = 8, 4


def parse_mix(text: str) -> list[tuple[int, int, int]]:
    """``"128x128x9:2,64x128x5"`` -> [(height, width, frames)] per row (``HxWxF:count``)."""
    rows = []
    for part in text.split(","):
        size, _, count = part.partition(":")
        h, w, f = (int(x) for x in size.lower().split("x"))
        rows += [(h, w, f)] * int(count or 1)
    return rows


def latent_size(size: tuple[int, int, int]) -> tuple[int, int, int]:
    """(F_lat, h, w) of a (height, width, frames) request."""
    h, w, f = size
    return (f - 1) // TEMPORAL + 1, h // SPATIAL, w // SPATIAL


def build(args, grouped) -> WanTransformer3DModel:
    """The transformer with diffserve's mixed-size plug-ins, length groups while `grouped()`."""
    if args.model:
        model = WanTransformer3DModel.from_pretrained(args.model, subfolder="transformer")
    else:
        torch.manual_seed(0)
        width = args.heads * args.head_dim
        model = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=args.heads,
                                      attention_head_dim=args.head_dim, in_channels=16, out_channels=16,
                                      text_dim=args.text_dim, ffn_dim=4 * width, num_layers=args.layers)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    model = model.to(args.device, dtype).eval()
    install_token_spans(model, grouped)
    return model


def inputs(model, sizes: list[tuple[int, int, int]], text: int, device, dtype,
           grid: tuple[int, int, int] | None = None) -> dict:
    """Forward kwargs of rows `sizes` (pixels, frames): latents zero-padded to `grid` (default:
    the largest of each axis)."""
    g = torch.Generator().manual_seed(0)
    latents = [latent_size(s) for s in sizes]
    grid = grid or tuple(max(axis) for axis in zip(*latents))
    rows = []
    for f, h, w in latents:
        x = torch.randn(1, 16, f, h, w, generator=g)
        rows.append(F.pad(x, (0, grid[2] - w, 0, grid[1] - h, 0, grid[0] - f)))
    n = len(sizes)
    return dict(hidden_states=torch.cat(rows).to(device, dtype), timestep=torch.rand(n, generator=g).to(device) * 1000,
                encoder_hidden_states=torch.randn(n, text, model.config.text_dim, generator=g).to(device, dtype))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mix", default="128x128x9:2,64x128x9:2,128x64x5:1,64x64x1:1", help="HxWxF:rows,...")
    ap.add_argument("--model", default=None, help="a Wan folder (its transformer); default: random weights")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=48)
    ap.add_argument("--text-dim", type=int, default=256)
    ap.add_argument("--text", type=int, default=32, help="context tokens (a folded prompt's rows)")
    add_timing_arguments(ap, iters=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    switch = {"grouped": True}
    model = build(args, lambda: switch["grouped"])
    dtype = next(model.parameters()).dtype
    sizes = parse_mix(args.mix)
    rows = RowData({LATENT_SIZE: tuple(latent_size(s) for s in sizes)}, len(sizes))
    mixed_kw = inputs(model, sizes, args.text, args.device, dtype)
    grid = tuple(mixed_kw["hidden_states"].shape[2:])
    uniform_kw = inputs(model, [sizes[0]] * len(sizes), args.text, args.device, dtype, grid=grid)
    groups = [inputs(model, [s] * sizes.count(s), args.text, args.device, dtype) for s in dict.fromkeys(sizes)]

    sync = device_sync(args.device)

    @torch.inference_mode()
    def arm(name: str) -> None:
        if name in ("grouped", "padded"):
            switch["grouped"] = name == "grouped"
            with forward_rows(rows):
                model(**mixed_kw)
        elif name == "uniform":
            model(**uniform_kw)
        else:
            for kw in groups:
                model(**kw)

    # the warm-up call of each arm also builds the key mask and the size groups, built once per
    # batch composition
    times = time_arms(arm, ["grouped", "padded", "uniform", "per_size"], args.repeats, args.iters, sync)
    result, ratios = summarize(times, "grouped")
    ratios["padded/uniform"] = summarize(times, "padded")[1]["padded/uniform"]
    patch = model.config.patch_size
    tokens = {"real": sum(math.prod(d // p for d, p in zip(latent_size(s), patch)) for s in sizes),
              "padded": len(sizes) * math.prod(d // p for d, p in zip(grid, patch))}
    header = (f"rows {len(sizes)} ({args.mix}); tokens real {tokens['real']}, padded {tokens['padded']}; "
              f"text {args.text}; {args.device} {args.dtype}, {args.threads} thread(s)")
    print_summary(result, ratios, header, {"tokens": tokens}, args.json)


if __name__ == "__main__":
    main()
