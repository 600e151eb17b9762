"""Latency of video streams: time to first chunk, per-chunk latency alone, and the inter-chunk
gap under load (``--concurrency`` streams at once), on the built-in video model by default.

Arms, interleaved ``--repeats`` times (median [min-max] over repeats of each arm's median):

- ``solo``: one stream of ``--chunks`` chunks alone: time to first chunk (arrival -> first chunk
  event), per-chunk latency (the gap between consecutive chunk events);
- ``load``: ``--concurrency`` streams submitted together: time to first chunk and inter-chunk
  gap over all streams (median and the worst), and the frames per second they deliver together
  against ``concurrency`` x the solo arm's (how much batching the streams' steps buys);
- ``whole``: the same ``--concurrency`` requests as ordinary (non-streaming) generations of the
  same length (one request of ``F + (K - 1) * (F - 1)`` frames each): time to the whole video,
  the latency a stream's first chunk replaces.

Timestamps are the engine's own (`RequestMetrics.chunk_s`: seconds from arrival to each chunk
event). Usage::

    python benchmarks/streaming.py                      # 8 streams x 4 chunks, 3 repeats, 1 thread
    python benchmarks/streaming.py --model DIR --size 480x832 --frames 33 --steps 30

Prints one line per arm and a final JSON line.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from diffserve import DiffusionEngine, EngineConfig, SamplingParams
from diffserve.models.digits_video import DEFAULT_MODEL_PATH


def run_arm(engine: DiffusionEngine, arm: str, concurrency: int, base: dict, chunks: int, frames: int,
            seed: int) -> dict:
    """One arm; returns its per-request measurements (seconds) and the wall clock."""
    n = 1 if arm == "solo" else concurrency
    total = frames + (frames - 1) * (chunks - 1)
    if arm == "whole":
        params = [SamplingParams(seed=seed + i, num_frames=total, output_type="np", **base) for i in range(n)]
    else:
        params = [SamplingParams(seed=seed + i, num_frames=frames, num_chunks=chunks, output_type="np", **base)
                  for i in range(n)]
    start = time.perf_counter()
    outs = engine.generate(["a handwritten digit 3 moving right"] * n, params)
    wall = time.perf_counter() - start
    assert all(o.ok for o in outs), [o.error for o in outs]
    delivered = sum(len(o.videos[0]) for o in outs)
    if arm == "whole":
        return {"first_s": [o.metrics.total_s for o in outs], "gaps_s": [], "wall_s": wall, "frames": delivered}
    return {"first_s": [o.metrics.chunk_s[0] for o in outs],
            "gaps_s": [g for o in outs for g in np.diff(o.metrics.chunk_s)], "wall_s": wall, "frames": delivered}


def spread(values: list[float]) -> str:
    return f"{np.median(values):.3f} [{min(values):.3f}-{max(values):.3f}]"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL_PATH)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--frames", type=int, default=None, help="frames per chunk (model default)")
    parser.add_argument("--size", default=None, help="WxH (model default)")
    parser.add_argument("--steps", type=int, default=None, help="num_inference_steps (model default)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--load-format", default="default")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    engine = DiffusionEngine(EngineConfig(model=str(args.model), num_threads=args.threads, device=args.device,
                                          load_format=args.load_format, max_batch_size=4 * args.concurrency))
    spec = engine.spec
    frames = args.frames or spec.default_num_frames
    base: dict = {}
    if args.size:
        width, height = (int(v) for v in args.size.lower().split("x"))
        base.update(width=width, height=height)
    if args.steps:
        base["num_inference_steps"] = args.steps
    run_arm(engine, "solo", 1, base, 2, frames, 0)  # warm-up (first-call allocations, prompt cache)
    arms = ("solo", "load", "whole")
    results: dict[str, list[dict]] = {arm: [] for arm in arms}
    for repeat in range(args.repeats):
        for arm in arms:  # interleaved
            results[arm].append(run_arm(engine, arm, args.concurrency, base, args.chunks, frames, 100 * repeat))
    med = {arm: {"first_s": [float(np.median(r["first_s"])) for r in rs],
                 "worst_first_s": [float(np.max(r["first_s"])) for r in rs],
                 "gap_s": [float(np.median(r["gaps_s"])) if r["gaps_s"] else float("nan") for r in rs],
                 "worst_gap_s": [float(np.max(r["gaps_s"])) if r["gaps_s"] else float("nan") for r in rs],
                 "fps": [r["frames"] / r["wall_s"] for r in rs]} for arm, rs in results.items()}
    batching = [load / (args.concurrency * solo) for load, solo in zip(med["load"]["fps"], med["solo"]["fps"])]
    gap_ratio = [load / solo for load, solo in zip(med["load"]["gap_s"], med["solo"]["gap_s"])]
    first_vs_whole = [s / w for s, w in zip(med["load"]["first_s"], med["whole"]["first_s"])]
    print(f"model: {args.model}  chunks: {args.chunks} x {frames} frames  size: {args.size or 'default'}  "
          f"steps: {args.steps or spec.default_num_inference_steps}  threads: {args.threads}  "
          f"repeats: {args.repeats} (median [min-max] of each repeat's median)")
    print(f"solo stream:         time to first chunk {spread(med['solo']['first_s'])} s, per-chunk latency "
          f"{spread(med['solo']['gap_s'])} s, {spread(med['solo']['fps'])} frames/s")
    print(f"{args.concurrency} streams at once:  time to first chunk {spread(med['load']['first_s'])} s (worst "
          f"{spread(med['load']['worst_first_s'])}), inter-chunk gap {spread(med['load']['gap_s'])} s (worst "
          f"{spread(med['load']['worst_gap_s'])}), {spread(med['load']['fps'])} frames/s")
    print(f"{args.concurrency} whole videos:     time to the whole video {spread(med['whole']['first_s'])} s, "
          f"{spread(med['whole']['fps'])} frames/s")
    print(f"ratios: inter-chunk gap under load / solo per-chunk latency {spread(gap_ratio)}; frames/s of "
          f"{args.concurrency} streams / ({args.concurrency} x solo) {spread(batching)}; first chunk / whole "
          f"video under load {spread(first_vs_whole)}")
    result = {"concurrency": args.concurrency, "chunks": args.chunks, "frames": frames, "threads": args.threads,
              "arms": med, "gap_ratio": gap_ratio, "batching_gain": batching, "first_chunk_vs_whole": first_vs_whole}
    print(json.dumps(result))
    engine.shutdown()
    return result


if __name__ == "__main__":
    main()
