"""Lifetimes check of a multi-stage model under random aborts, through the engine.

`--num-requests` requests of the built-in `digits-reasoning` are queued at once; while the
engine steps, a few of them (0-6 per tick, in a fixed random order) are aborted wherever they
are: in the AR stage, waiting with their payloads, being prepared, denoising, being decoded.
Afterwards it prints where the aborts landed, the outcomes, what is still resident (AR side:
the connector's stored payloads; DiT side: pending fetches and received payloads), the
shared-memory segments the AR process left (``--executor multiprocess``), and the engine
process's RSS growth (after ``malloc_trim``). Everything should be 0 but the RSS growth,
which should stay within a few MiB.

Usage::

    python benchmarks/multistage_aborts.py --executor multiprocess --num-requests 200
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # training/ (out of the wheel)

from diffserve import DiffusionEngine, EngineConfig, SamplingParams  # noqa: E402
from diffserve.memory.accounting import release_host_memory, rss_bytes  # noqa: E402
from training.digits_reasoning import grammar  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--executor", choices=["inprocess", "multiprocess"], default="multiprocess")
    parser.add_argument("--num-requests", type=int, default=200)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    engine = DiffusionEngine(EngineConfig(model="digits-reasoning", num_threads=args.threads, max_batch_size=16,
                                          executor=args.executor))
    try:
        engine.generate("twice 2", SamplingParams(num_inference_steps=args.steps))  # warm-up
        release_host_memory()
        before = rss_bytes()
        problems = grammar.all_problems()
        rng = random.Random(args.seed)
        ids = [engine.add_request(problems[k * 7 % len(problems)].prompt,
                                  SamplingParams(seed=k, num_inference_steps=args.steps))
               for k in range(args.num_requests)]
        pending = list(ids)
        rng.shuffle(pending)
        phases: dict[str, int] = {}
        outcomes: dict[str, int] = {}
        while engine.has_unfinished_requests():
            for event in engine.step():
                if event.type.is_final:
                    outcomes[event.output.status.value] = outcomes.get(event.output.status.value, 0) + 1
            for _ in range(rng.randint(0, 6)):
                if pending:
                    request_id = pending.pop()
                    request = engine.scheduler.requests.get(request_id)
                    if request is not None:
                        phases[request.phase.value] = phases.get(request.phase.value, 0) + 1
                    engine.abort(request_id)
        time.sleep(1.0)  # AR-side aborts resolve on the stage's threads
        release_host_memory()
        stats = engine.stats()
        segments = 0
        if engine.ar_stage is not None and getattr(engine.ar_stage, "_proc", None) is not None:
            segments = len(list(Path("/dev/shm").glob(f"diffserve-{engine.ar_stage._proc.pid}-*")))
        report = {"aborted_in_phase": phases, "outcomes": outcomes,
                  "ar_resident_bytes": stats["ar_stage"]["connector"]["resident_bytes"],
                  "dit_pending_fetches": stats["payloads"]["pending"],
                  "dit_resident_bytes": stats["payloads"]["connector"]["resident_bytes"],
                  "segments_left": segments, "rss_growth_mib": round((rss_bytes() - before) / 2**20, 2)}
    finally:
        engine.shutdown()
    print(f"executor {args.executor}, {args.num_requests} requests, {args.steps} steps")
    for key, value in report.items():
        print(f"{key}: {value}")
    return report


if __name__ == "__main__":
    main()
