"""Padding with masks vs packing, for rows of different token counts in one DiT forward (the
choice behind `diffserve.pipelines.token_spans`).

One MM-DiT-like block (q/k/v projections, attention over image + context tokens, output
projection, a 4x MLP) runs over rows whose image token counts come from a mix of sizes, three
ways, interleaved per repeat:

- ``padded``: rows padded to the longest (B, L_max + L_ctx, D); SDPA with a (B, 1, 1, L) mask
  that hides each row's padded keys (what `token_spans` does);
- ``padded_loop``: the padded layout for every token-wise layer, attention one row at a time
  over its real tokens only (no mask: SDPA's fused CPU kernel);
- ``packed_mask``: every row's tokens in one sequence (1, sum L_i, D); SDPA with a dense
  block-diagonal mask (the only packed attention PyTorch's CPU SDPA offers);
- ``packed_loop``: the same packed sequence, attention one row segment at a time (what a
  varlen kernel does in one launch on a GPU; on CPU the loop is its stand-in); the linear
  layers run on the packed tokens only.

The per-row adaLN modulation of a real block is left out: padding keeps it a (B, D) broadcast,
packing would need a per-token gather (extra cost on the packed arms, not counted here).

Usage::

    python benchmarks/mixed_attention.py                 # built-in mix, width 384, 1 thread
    python benchmarks/mixed_attention.py --mix 1024:4,256:4 --repeats 5 --json

Prints, per arm, the median and [min, max] ms per block and the ratio to ``padded``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from interleaved_arms import add_timing_arguments  # benchmarks/interleaved_arms.py (same folder)


def _block(x: torch.Tensor, w: dict[str, torch.Tensor], heads: int, attend) -> torch.Tensor:
    q, k, v = (x @ w[n] for n in ("q", "k", "v"))
    b, n, d = q.shape
    q, k, v = (t.view(b, n, heads, d // heads).transpose(1, 2) for t in (q, k, v))
    out = attend(q, k, v).transpose(1, 2).reshape(b, n, d) @ w["o"]
    x = x + out
    return x + F.gelu(x @ w["up"]) @ w["down"]


def run(mix: list[tuple[int, int]], ctx: int, width: int, heads: int, repeats: int, iters: int) -> dict:
    """Median / min / max milliseconds per block of each arm (see the module docstring)."""
    torch.manual_seed(0)
    w = {n: torch.randn(width, width) / width ** 0.5 for n in ("q", "k", "v", "o")}
    w["up"], w["down"] = torch.randn(width, 4 * width) / width ** 0.5, torch.randn(4 * width, width) / width ** 0.5
    lengths = [tokens + ctx for tokens, count in mix for _ in range(count)]
    longest, rows = max(lengths), len(lengths)
    padded = torch.randn(rows, longest, width)
    key_mask = torch.arange(longest)[None, :] < torch.tensor(lengths)[:, None]  # context follows here too
    mask = key_mask[:, None, None, :]
    packed = torch.cat([padded[r, :n] for r, n in enumerate(lengths)])[None]
    seg = torch.repeat_interleave(torch.arange(rows), torch.tensor(lengths))
    block_mask = (seg[:, None] == seg[None, :])[None, None]
    bounds = torch.tensor([0, *lengths]).cumsum(0).tolist()

    def loop(q, k, v):
        return torch.cat([F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b])
                          for a, b in zip(bounds, bounds[1:])], dim=2)

    def row_loop(q, k, v):  # padded layout, each row's attention over its real tokens only
        out = torch.zeros_like(q)
        for r, n in enumerate(lengths):
            out[r:r + 1, :, :n] = F.scaled_dot_product_attention(q[r:r + 1, :, :n], k[r:r + 1, :, :n],
                                                                 v[r:r + 1, :, :n])
        return out

    arms = {
        "padded": lambda: _block(padded, w, heads, lambda q, k, v: F.scaled_dot_product_attention(q, k, v, mask)),
        "padded_loop": lambda: _block(padded, w, heads, row_loop),
        "packed_mask": lambda: _block(packed, w, heads,
                                      lambda q, k, v: F.scaled_dot_product_attention(q, k, v, block_mask)),
        "packed_loop": lambda: _block(packed, w, heads, loop),
    }
    times: dict[str, list[float]] = {a: [] for a in arms}
    with torch.inference_mode():
        for fn in arms.values():
            fn()
        for rep in range(repeats):
            order = list(arms) if rep % 2 == 0 else list(reversed(arms))
            for name in order:
                start = time.perf_counter()
                for _ in range(iters):
                    arms[name]()
                times[name].append((time.perf_counter() - start) / iters * 1000)
    base = statistics.median(times["padded"])
    return {"rows": rows, "tokens": sum(lengths), "padded_tokens": rows * longest,
            "arms": {a: {"median_ms": statistics.median(t), "min_ms": min(t), "max_ms": max(t),
                         "vs_padded": statistics.median(t) / base} for a, t in times.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mix", default="1024:4,576:4,256:8",
                        help="image tokens:rows pairs (default: 64x64, 48x48 and 32x32 latents at patch 2)")
    parser.add_argument("--ctx", type=int, default=77, help="context tokens per row")
    parser.add_argument("--width", type=int, default=384)
    parser.add_argument("--heads", type=int, default=6)
    add_timing_arguments(parser, repeats=3, dtypes=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    mix = [tuple(int(x) for x in part.split(":")) for part in args.mix.split(",")]
    result = run(mix, args.ctx, args.width, args.heads, args.repeats, args.iters)
    if args.json:
        print(json.dumps(result))
        return
    print(f"{result['rows']} rows, {result['tokens']} real tokens, {result['padded_tokens']} padded "
          f"({args.threads} thread(s), width {args.width}, {args.repeats} repeats x {args.iters})")
    for name, r in result["arms"].items():
        print(f"  {name:12s} {r['median_ms']:8.1f} ms [{r['min_ms']:.1f}, {r['max_ms']:.1f}]  "
              f"x{r['vs_padded']:.2f} of padded")


if __name__ == "__main__":
    main()
