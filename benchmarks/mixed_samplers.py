"""Per-request samplers benchmark: 8 concurrent requests with one sampler vs with mixed samplers.

Arms (one process, the same engine, arms interleaved inside each repeat, median of
``--repeats`` with the range):
  uniform  every request ``scheduler="euler"`` (flow-matching Euler): one forward per step for
           all of them, the step one batched tensor expression;
  mixed    the requests cycle through ``--samplers`` (default euler, dpmpp_2m, unipc): still one
           forward per step for all of them (the sampler is per-request state, not part of the
           batch key), the step per row (Euler rows by their sigma step, the others by their own
           scheduler's ``step``);
  split    the same mixed requests, each sampler's requests as their own batches in turn (what a
           batch key holding the sampler would do): the forwards sharing saves.

Throughput is images/s (requests / seconds of the arm: wall seconds, or with ``--clock process``
this process's CPU seconds, which other processes on a shared machine barely change). The model
is the SD3-architecture random-weight folder of ``benchmarks/lora.py`` (``--layers``, ``--heads``,
``--size``), or any SD3 folder given with ``--model``.

Usage:
    python benchmarks/mixed_samplers.py                      # CPU defaults, 3 repeats, 1 thread
    python benchmarks/mixed_samplers.py --clock process      # CPU seconds: a shared, loaded machine
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import tempfile
import time
from pathlib import Path

import torch

from diffserve import DiffusionEngine, EngineConfig, SamplingParams

PROMPTS = ["a red apple on a table", "a mountain lake at dawn", "a portrait of an old sailor", "a city at night"]


def _lora_benchmark():
    """``benchmarks/lora.py`` as a module (its SD3 folder builder)."""
    spec = importlib.util.spec_from_file_location("lora_benchmark", Path(__file__).with_name("lora.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def workload(args, samplers: list[str]) -> list[tuple[str, SamplingParams]]:
    """`args.requests` requests, request i with sampler ``samplers[i % len(samplers)]``."""
    return [(PROMPTS[i % len(PROMPTS)],
             SamplingParams(seed=i, num_inference_steps=args.steps, guidance_scale=4.0, height=args.size,
                            width=args.size, output_type="latent", scheduler=samplers[i % len(samplers)]))
            for i in range(args.requests)]


def run(engine: DiffusionEngine, work: list[tuple[str, SamplingParams]], split: bool, clock) -> float:
    """Seconds to serve `work`: all at once, or (`split`) each sampler's requests in turn."""
    groups: dict[str | None, list] = {}
    for prompt, params in work:
        groups.setdefault(params.scheduler if split else None, []).append((prompt, params))
    start = clock()
    for group in groups.values():
        outs = engine.generate([p for p, _ in group], [q for _, q in group])
        assert all(o.ok for o in outs), [o.error for o in outs if not o.ok]
        if not split:  # every request shared every forward
            assert all(max(o.metrics.batch_sizes) == 2 * len(group) for o in outs), outs[0].metrics.batch_sizes
    return clock() - start


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="an SD3 folder (default: build one, see --layers)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=6, help="attention heads of 64 channels")
    ap.add_argument("--size", type=int, default=128, help="image side, pixels")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--samplers", default="euler,dpmpp_2m,unipc")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    ap.add_argument("--clock", choices=("wall", "process"), default="wall")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "process" else time.perf_counter
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.model or _lora_benchmark().build_folder(Path(tmp) / "sd3", args.layers, args.heads, args.size,
                                                              16)
        engine = DiffusionEngine(EngineConfig(model=str(folder), num_threads=args.threads or None,
                                              max_batch_size=2 * args.requests))
        try:
            uniform = workload(args, ["euler"])
            mixed = workload(args, args.samplers.split(","))
            run(engine, mixed, False, clock)  # warm-up (schedulers' templates, allocator)
            times: dict[str, list[float]] = {"uniform": [], "mixed": [], "split": []}
            for _ in range(args.repeats):
                times["uniform"].append(run(engine, uniform, False, clock))
                times["mixed"].append(run(engine, mixed, False, clock))
                times["split"].append(run(engine, mixed, True, clock))
        finally:
            engine.shutdown()
    result = {}
    print(f"{args.requests} requests x {args.steps} steps, {args.size}px, threads={args.threads}, "
          f"clock={args.clock}, samplers={args.samplers}; images/s median [min-max] of {args.repeats}")
    for arm, seconds in times.items():
        rates = sorted(args.requests / s for s in seconds)
        result[arm] = statistics.median(rates)
        print(f"  {arm:8s} {result[arm]:7.2f} [{rates[0]:.2f}-{rates[-1]:.2f}]")
    print(f"  mixed / uniform = {result['mixed'] / result['uniform']:.2f}; "
          f"mixed / split = {result['mixed'] / result['split']:.2f}")
    return result


if __name__ == "__main__":
    main()
