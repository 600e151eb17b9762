"""Serving benchmark of a multi-stage model (an AR stage feeding the DiT through a KV connector):
diffserve's pipelined stages vs diffusers-style serial stages.

Arms (one process, the same closed-loop workload, arms interleaved; `--repeats R` runs them R
times and reports medians with ranges; `--json` ends with a machine-readable line):

- ``serial``: diffusers-style, one request at a time: the reference pipeline
  (`DigitsReasoningPipeline.__call__`: the LM answers, then the DiT denoises) per request, in
  arrival order.
- ``serial_batched``: diffusers-style stages with batching: whenever idle, ONE pipeline call on
  every request that has arrived (up to the concurrency): a batched ``generate`` for all of them,
  then a batched denoising loop; a request arriving meanwhile waits for the next call.
- ``pipelined``: diffserve: the AR stage batches generation with transformers' continuous
  batching on its own thread, its K/V go through the connector, and the DiT stage runs
  step-level continuous batching; new requests' AR generation overlaps running requests'
  denoising steps. ``pipelined_mp`` (optional): the same with ``--executor multiprocess`` (the
  AR stage in its own process, K/V through shared memory).

Load: `--concurrency N` clients, each sending its next request when the previous one returns,
`--num-requests` in all (prompts of the model's grammar, seeds 0, 1, ...). Reported per arm:
throughput (requests/s), latency p50 / p99 (s, from a client's send to its result), and for the
diffserve arms the DiT-side wait for the payload (p50 / max, s: from the DiT stage asking for a
request's K/V to having them; ~0 with admission-time prefetch) and the AR stage's share.

Usage::

    python benchmarks/multistage_serving.py --concurrency 16 --num-requests 64 --steps 20 --threads 1 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # training/ (out of the wheel)

from diffserve import DiffusionEngine, EngineConfig, SamplingParams  # noqa: E402
from diffserve.models import BUILTIN_MODELS  # noqa: E402
from training.digits_reasoning import grammar  # noqa: E402

ARMS = ("serial", "serial_batched", "pipelined", "pipelined_mp")


@dataclass
class ArmResult:
    """One run of one arm (seconds)."""

    arm: str
    wall_s: float
    latencies: list[float]
    payload_waits: list[float] = field(default_factory=list)
    ar_s: list[float] = field(default_factory=list)

    @property
    def throughput(self) -> float:
        return len(self.latencies) / self.wall_s

    def pct(self, values: list[float], q: float) -> float:
        return float(np.percentile(values, q)) if values else float("nan")


def workload(n: int) -> list[str]:
    """`n` prompts cycling through the whole grammar (a fixed order)."""
    problems = grammar.all_problems()
    order = np.random.default_rng(0).permutation(len(problems))
    return [problems[order[k % len(problems)]].prompt for k in range(n)]


def run_serial(pipe, prompts: list[str], concurrency: int, steps: int, batched: bool) -> ArmResult:
    """diffusers-style serving on one thread: a closed loop of `concurrency` clients whose
    requests a single server runs one at a time (``batched=False``) or all waiting ones in one
    pipeline call (``batched=True``). Arrival times follow the closed loop exactly: a client
    sends its next request when its previous one completes."""
    waiting: deque[tuple[int, float]] = deque()
    start = time.perf_counter()
    sent = 0
    for _ in range(min(concurrency, len(prompts))):
        waiting.append((sent, start))
        sent += 1
    latencies = []
    while waiting:
        take = len(waiting) if batched else 1
        batch = [waiting.popleft() for _ in range(take)]
        pipe([prompts[i] for i, _ in batch], num_inference_steps=steps, output_type="np",
             generator=[torch.Generator().manual_seed(i) for i, _ in batch])
        now = time.perf_counter()
        for _, arrived in batch:
            latencies.append(now - arrived)
            if sent < len(prompts):
                waiting.append((sent, now))
                sent += 1
    return ArmResult("serial_batched" if batched else "serial", time.perf_counter() - start, latencies)


def run_engine(engine: DiffusionEngine, prompts: list[str], concurrency: int, steps: int, arm: str) -> ArmResult:
    """`concurrency` client threads calling ``engine.generate`` back to back."""
    lock = threading.Lock()
    next_index = [0]
    results: list[tuple[float, object]] = []

    def client() -> None:
        while True:
            with lock:
                i = next_index[0]
                if i >= len(prompts):
                    return
                next_index[0] += 1
            sent = time.perf_counter()
            [out] = engine.generate(prompts[i], SamplingParams(num_inference_steps=steps, seed=i, output_type="np"))
            if out.error:
                raise RuntimeError(out.error)
            with lock:
                results.append((time.perf_counter() - sent, out))

    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    metrics = [out.metrics for _, out in results]
    return ArmResult(arm, wall, [lat for lat, _ in results],
                     payload_waits=[m.payload_wait_s for m in metrics],
                     ar_s=[m.ar_s for m in metrics])


def summary(runs: list[ArmResult], serial: list[ArmResult]) -> dict:
    def med(values):
        return statistics.median(values), min(values), max(values)

    out = {"arm": runs[0].arm, "throughput": med([r.throughput for r in runs]),
           "p50_s": med([r.pct(r.latencies, 50) for r in runs]), "p99_s": med([r.pct(r.latencies, 99) for r in runs]),
           "speedup_vs_serial": med([r.throughput / s.throughput for r, s in zip(runs, serial)])}
    if runs[0].payload_waits:
        out["payload_wait_p50_s"] = med([r.pct(r.payload_waits, 50) for r in runs])
        out["payload_wait_max_s"] = med([max(r.payload_waits) for r in runs])
        out["ar_s_p50"] = med([r.pct(r.ar_s, 50) for r in runs])
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="digits-reasoning")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--arms", default="serial,serial_batched,pipelined")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    arms = args.arms.split(",")
    unknown = set(arms) - set(ARMS)
    if unknown or "serial" not in arms:
        parser.error(f"--arms must include serial and be among {ARMS}")
    from diffserve.pipelines.digits_reasoning.pipeline import DigitsReasoningPipeline

    folder = BUILTIN_MODELS.get(args.model, Path(args.model))
    pipe = DigitsReasoningPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    engines = {}
    if "pipelined" in arms:
        engines["pipelined"] = DiffusionEngine(EngineConfig(model=str(folder), num_threads=args.threads,
                                                            max_batch_size=2 * args.concurrency))
    if "pipelined_mp" in arms:
        engines["pipelined_mp"] = DiffusionEngine(EngineConfig(model=str(folder), num_threads=args.threads,
                                                               max_batch_size=2 * args.concurrency,
                                                               executor="multiprocess"))
    prompts = workload(args.num_requests)
    warm = prompts[: args.concurrency]
    run_serial(pipe, warm, args.concurrency, 2, True)
    for name, engine in engines.items():
        run_engine(engine, warm, args.concurrency, 2, name)
    runs: dict[str, list[ArmResult]] = {a: [] for a in arms}
    try:
        for repeat in range(args.repeats):
            order = arms if repeat % 2 == 0 else list(reversed(arms))
            for arm in order:
                if arm in ("serial", "serial_batched"):
                    result = run_serial(pipe, prompts, args.concurrency, args.steps, arm == "serial_batched")
                else:
                    result = run_engine(engines[arm], prompts, args.concurrency, args.steps, arm)
                runs[arm].append(result)
                print(f"repeat {repeat} {arm:15s} {result.throughput:7.2f} req/s  p50 {result.pct(result.latencies, 50):6.2f} s  "
                      f"p99 {result.pct(result.latencies, 99):6.2f} s", flush=True)
    finally:
        for engine in engines.values():
            engine.shutdown()
    table = [summary(runs[a], runs["serial"]) for a in arms]
    print(f"\nmodel {args.model}, concurrency {args.concurrency}, {args.num_requests} requests, {args.steps} steps, "
          f"{args.threads} thread(s), {args.repeats} repeats: median [min, max]")
    print("| arm | requests/s | x serial | p50 s | p99 s | DiT-side payload wait p50 / max s | AR s p50 |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    fmt = lambda v, d=2: f"{v[0]:.{d}f} [{v[1]:.{d}f}, {v[2]:.{d}f}]"  # noqa: E731
    for row in table:
        wait = (f"{fmt(row['payload_wait_p50_s'], 4)} / {fmt(row['payload_wait_max_s'], 4)}"
                if "payload_wait_p50_s" in row else "-")
        ar = fmt(row["ar_s_p50"], 3) if "ar_s_p50" in row else "-"
        print(f"| {row['arm']} | {fmt(row['throughput'])} | {fmt(row['speedup_vs_serial'])} | {fmt(row['p50_s'])} | "
              f"{fmt(row['p99_s'])} | {wait} | {ar} |")
    if args.json:
        print(json.dumps(table))
    return table


if __name__ == "__main__":
    main()
