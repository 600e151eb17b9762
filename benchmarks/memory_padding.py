"""Does the memory budget hold when a forward mixes sizes? Measured step peaks of a large and a
small request under a ``max_memory`` that fits both at their own sizes but not the small one's
rows padded to the large one's.

Arms (the same workload each, every trial in a fresh subprocess, arms interleaved):
``aware`` (this engine: a step batch counts its padding, `diffserve.engine.queues`) and
``blind`` (the same engine with `MemoryBudget.token_bytes` returning 0, so the step batch sees
no padding: the rule before padding was counted; admission is the same in both).

Per trial: an engine with a generous ``max_memory`` measures the model's memory profile; the
limit is then set to ``weights + reserve + both requests' own estimates + --pad-share x the
estimated padding`` of the shared forward (default 0.5: half the padding fits), and an engine
with that limit (same runner) serves one warm-up request alone, then the large and the small
request together. Reported per arm: whether they shared a forward (most rows in a step), the
larger of the two requests' ``request_peak_memory_bytes`` (the most any step used above the
resident model: CPU RSS high-water mark above the idle engine's RSS, CUDA allocator peak above
the weights) and ``limit_above_weights`` (``max_memory`` - weights: what the budget promises
the steps stay within); medians with (min, max) over the trials.

Usage:
    python benchmarks/memory_padding.py                      # tiny SD3 folder, built in a temp dir
    python benchmarks/memory_padding.py --model DIR --large 512 --small 64 --trials 3 --threads 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ARMS = ("aware", "blind")


def run_arm(args: argparse.Namespace) -> dict:
    """One trial of one arm in this process (the child side)."""
    import torch

    from diffserve import DiffusionEngine, EngineConfig, SamplingParams
    from diffserve.engine.memory_budget import MemoryBudget

    torch.set_num_threads(args.threads)
    if args.arm == "blind":
        MemoryBudget.token_bytes = lambda self, params, rows: 0
    profiled = DiffusionEngine(EngineConfig(model=args.model, max_memory="64GiB", overlap_stages=False))
    budget, spec, limits = profiled.memory_budget, profiled.spec, profiled.config.limits
    jobs = [("a red fox", SamplingParams(seed=1, num_inference_steps=args.steps, output_type="np",
                                         height=args.large, width=args.large)),
            ("a blue bird", SamplingParams(seed=2, num_inference_steps=args.steps, output_type="np",
                                           height=args.small, width=args.small))]
    resolved = [p.resolve(spec, limits, 0) for _, p in jobs]
    f = spec.resolution_factor
    rows = 2  # CFG: two rows each
    tokens = [rows * (p.height // f) * (p.width // f) for p in resolved]
    slot = max(-(-budget.profile.token_bytes(p.height, p.width, rows) // t) for p, t in zip(resolved, tokens))
    pad = slot * (2 * rows * (args.large // f) ** 2 - sum(tokens))
    own = sum(budget.request_bytes(p, rows) for p in resolved)
    weights, reserve = budget.profile.weight_bytes, budget.profile.reserve_bytes
    limit = weights + reserve + own + int(args.pad_share * pad)
    engine = DiffusionEngine(EngineConfig(model=args.model, max_memory=limit, overlap_stages=False),
                             runner=profiled.runner)
    engine.generate(["warm-up"], [jobs[0][1]])
    step_rows: list[int] = []
    engine.add_step_listener(lambda n, k, s: step_rows.append(n))
    outs = engine.generate([p for p, _ in jobs], [s for _, s in jobs])
    assert all(o.ok for o in outs), [o.error for o in outs]
    peaks = [o.metrics.request_peak_memory_bytes for o in outs]
    return {"arm": args.arm, "shared_forward": max(step_rows) > rows, "step_peak_bytes": max(p or 0 for p in peaks),
            "limit_above_weights": limit - weights, "estimated_own_bytes": own, "estimated_padding_bytes": pad,
            "reserve_bytes": reserve, "method": budget.profile.method}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model folder (default: a tiny SD3 folder built in a temp dir)")
    parser.add_argument("--large", type=int, default=512, help="side of the large request (px)")
    parser.add_argument("--small", type=int, default=64, help="side of the small request (px)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--pad-share", type=float, default=0.5,
                        help="share of the estimated padding the limit leaves room for (below 1: it does not fit)")
    parser.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)  # child: one trial of one arm
    args = parser.parse_args()
    if args.arm:
        print(json.dumps(run_arm(args)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        if args.model is None:
            sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
            from tiny_models.sd3 import build_tiny_sd3

            args.model = str(build_tiny_sd3(Path(tmp) / "sd3"))
        results: dict[str, list[dict]] = {arm: [] for arm in ARMS}
        for _ in range(args.trials):
            for arm in ARMS:
                cmd = [sys.executable, __file__, "--arm", arm, "--model", args.model, "--large", str(args.large),
                       "--small", str(args.small), "--steps", str(args.steps), "--threads", str(args.threads),
                       "--pad-share", str(args.pad_share)]
                done = subprocess.run(cmd, capture_output=True, text=True)
                if done.returncode:
                    raise SystemExit(f"{arm} trial failed:\n{done.stderr[-3000:]}")
                results[arm].append(json.loads(done.stdout.strip().splitlines()[-1]))
    summary = {}
    for arm, trials in results.items():
        peaks = [t["step_peak_bytes"] for t in trials]
        limit = [t["limit_above_weights"] for t in trials]
        summary[arm] = {"shared_forward": [t["shared_forward"] for t in trials],
                        "step_peak_bytes": {"median": statistics.median(peaks), "min": min(peaks), "max": max(peaks)},
                        "limit_above_weights": {"median": statistics.median(limit), "min": min(limit),
                                                "max": max(limit)},
                        "within_limit": [t["step_peak_bytes"] <= t["limit_above_weights"] for t in trials],
                        "estimated_padding_bytes": statistics.median(t["estimated_padding_bytes"] for t in trials),
                        "method": trials[0]["method"]}
        print(arm, json.dumps(summary[arm]), flush=True)
    print(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "arm"}, "arms": summary}))


if __name__ == "__main__":
    main()
