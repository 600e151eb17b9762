"""Acceleration benchmark: cache backends, regional compile and the prompt-embedding cache.

One run generates the same prompts with the same seeds under every setting and prints, per
setting:

* mean seconds per image (wall clock of the whole ``generate`` call / images) and its speedup
  vs ``none``; denoise seconds (time inside the runner's denoising steps) and its speedup;
  encode seconds (prompt encoding, what the prompt cache saves);
* the fraction of request-steps whose transformer blocks were skipped;
* judge accuracy (the digit classifier of ``benchmarks/quality.py``; default model only);
* PSNR (dB, pixels in [0, 1], over all images) and max abs pixel difference vs the ``none``
  image of the same prompt and seed.

Each prompt is used ``--repeats`` times with different seeds (repeated prompts, as in
serving), all requests are submitted at once (step-level batching, ``--max-batch-size`` rows).
Engine start-up (load, compile warm-up) and one small warm-up request are excluded from the
timings. The machine's load average is printed: other processes on the CPU skew timings.

Usage::

    python benchmarks/acceleration.py                      # built-in digits model, 20 steps
    python benchmarks/acceleration.py --steps 50 --settings none teacache-0.6 cache_dit-tuned
    python benchmarks/acceleration.py --model DIR --prompt "a cat" --prompt "a dog"
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

#: name -> EngineConfig overrides. Thresholds were picked on the default model (see the
#: teacache module docstring for its calibration).
SETTINGS: dict[str, dict] = {
    "none": {},
    "none-no-prompt-cache": {"prompt_embed_cache_size": 0},
    "teacache-0.3": {"cache_backend": "teacache", "cache_config": {"rel_l1_thresh": 0.3}},
    "teacache-0.6": {"cache_backend": "teacache", "cache_config": {"rel_l1_thresh": 0.6}},
    "teacache-1.0": {"cache_backend": "teacache", "cache_config": {"rel_l1_thresh": 1.0}},
    "cache_dit-default": {"cache_backend": "cache_dit"},
    "cache_dit-tuned": {"cache_backend": "cache_dit", "cache_config": {
        "Fn_compute_blocks": 1, "residual_diff_threshold": 0.12, "max_warmup_steps": 4}},
    "cache_dit-tuned-taylorseer": {"cache_backend": "cache_dit", "cache_config": {
        "Fn_compute_blocks": 1, "residual_diff_threshold": 0.12, "max_warmup_steps": 4,
        "taylorseer": True}},
    "compile": {"compile": True},
    "compile+teacache-0.6": {"compile": True, "cache_backend": "teacache",
                             "cache_config": {"rel_l1_thresh": 0.6}},
}


@dataclass
class Result:
    """One setting's measurements (seconds are totals over all images)."""

    name: str
    images: np.ndarray
    wall_s: float
    denoise_s: float
    encode_s: float
    skip_fraction: float
    stats: dict


def run_setting(name: str, overrides: dict, model: str | None, prompts: list[str], seeds: list[int],
                steps: int, guidance: float | None, max_batch_size: int, size: int | None) -> Result:
    """Build an engine for one setting, warm it up, and time one generate call."""
    from diffserve import DiffusionEngine, EngineConfig, SamplingParams

    engine = DiffusionEngine(EngineConfig(model=model, max_batch_size=max_batch_size, **overrides))
    runner = engine.runner
    timers = {"denoise": 0.0, "encode": 0.0}

    def timed(fn, key):
        depth = [0]  # execute_step recurses (one request per forward): count the outer call

        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1
                if depth[0] == 0:
                    timers[key] += time.perf_counter() - start
        return wrapper

    runner.execute_step = timed(runner.execute_step, "denoise")
    runner.prepare = timed(runner.prepare, "encode")  # prompt encoding dominates prepare

    def params(seed: int, n_steps: int) -> SamplingParams:
        return SamplingParams(seed=seed, num_inference_steps=n_steps, guidance_scale=guidance,
                              height=size, width=size, output_type="np")

    engine.generate("warm-up request", params(10**6, 2))
    before = runner.acceleration_stats()["cache_backend"]
    timers.update(denoise=0.0, encode=0.0)
    start = time.perf_counter()
    outputs = engine.generate(prompts, [params(s, steps) for s in seeds])
    wall = time.perf_counter() - start
    failed = [o.error for o in outputs if not o.ok]
    if failed:
        raise RuntimeError(f"{name}: {len(failed)} requests failed, first: {failed[0]}")
    stats = runner.acceleration_stats()
    after = stats["cache_backend"]
    calls = after["transformer_calls"] - before["transformer_calls"]
    skipped = after["skipped"] - before["skipped"]
    images = np.stack([np.asarray(o.images)[0] for o in outputs]).astype(np.float64)
    return Result(name, images, wall, timers["denoise"], timers["encode"],
                  skipped / calls if calls else 0.0, stats)


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """PSNR in dB of images in [0, 1] over all pixels (inf when identical)."""
    mse = float(np.mean((a - b) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(1.0 / mse)


def main(argv: list[str] | None = None) -> list[Result]:
    """Run every selected setting and print the table (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="diffusers folder (default: built-in digits model)")
    parser.add_argument("--prompt", action="append", default=None,
                        help="repeatable; default: digit prompts, scored by the digit judge")
    parser.add_argument("--n-per-digit", type=int, default=5, help="digit prompts per digit")
    parser.add_argument("--repeats", type=int, default=2, help="seeds per prompt (repeated prompts)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--guidance", type=float, default=None, help="default: the model's")
    parser.add_argument("--size", type=int, default=None, help="height = width in pixels (model default)")
    parser.add_argument("--seed", type=int, default=0, help="image k uses seed + k")
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    labels = None
    if args.prompt is None:  # digit prompts, scored by the digit judge
        from diffserve.models.digits import data
        from quality import make_prompts

        base, base_labels = make_prompts(data.TRAIN_TEMPLATES + data.HELDOUT_TEMPLATES, args.n_per_digit)
        labels = np.repeat(base_labels, args.repeats)
    else:
        base = args.prompt
    prompts = [p for p in base for _ in range(args.repeats)]
    seeds = [args.seed + k for k in range(len(prompts))]
    names = ["none"] + [n for n in args.settings if n != "none"]

    print("command: python benchmarks/acceleration.py " + shlex.join(sys.argv[1:] if argv is None else argv))
    print(f"model: {args.model or 'built-in digits'}  images: {len(prompts)} ({len(set(prompts))} distinct "
          f"prompts x {args.repeats} seeds)  steps: {args.steps}  max_batch_size: {args.max_batch_size}")
    print(f"torch threads: {torch.get_num_threads()}  load average: "
          + " ".join(f"{x:.2f}" for x in os.getloadavg()))

    judge = None
    if labels is not None:
        from quality import build_judge, judge_images

        judge, _ = build_judge()
    results = []
    for name in names:
        results.append(run_setting(name, SETTINGS[name], args.model, prompts, seeds, args.steps,
                                   args.guidance, args.max_batch_size, args.size))
        r = results[-1]
        print(f"  ran {name}: {r.wall_s:.2f} s", file=sys.stderr)
    base_r = results[0]
    n = len(prompts)
    print()
    print("| setting | s/image | speedup | denoise s | denoise speedup | encode s | skipped | "
          "judge acc | PSNR vs none | max abs diff |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        accuracy = "-"
        if judge is not None:
            accuracy = f"{100 * np.mean(judge_images(judge, r.images) == labels):.1f} %"
        p = psnr(r.images, base_r.images)
        print(f"| {r.name} | {r.wall_s / n:.4f} | {base_r.wall_s / r.wall_s:.2f}x | {r.denoise_s:.2f} | "
              f"{base_r.denoise_s / r.denoise_s:.2f}x | {r.encode_s:.3f} | {100 * r.skip_fraction:.0f} % | "
              f"{accuracy} | {'inf' if math.isinf(p) else f'{p:.1f}'} dB | "
              f"{np.abs(r.images - base_r.images).max():.4f} |")
    print()
    for r in results:
        s = r.stats
        extra = [f"prompt cache hits/misses {s['prompt_embed_cache'].get('hits', '-')}/"
                 f"{s['prompt_embed_cache'].get('misses', '-')}"]
        if s["compile"]["enabled"] or s["compile"].get("fallback_reason"):
            c = s["compile"]
            extra.append(f"compile warm-up {c['warmup_s']:.1f} s, graphs {c['graphs_compiled']}, "
                         f"recompiles after warm-up {c['recompiles_after_warmup']}, "
                         f"fallback {c['fallback_reason']}")
        print(f"{r.name}: " + "; ".join(extra))
    return results


if __name__ == "__main__":
    main()
