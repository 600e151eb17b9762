"""Acceleration benchmark: cache backends, regional compile and the prompt-embedding cache.

One run generates the same prompts with the same seeds under every setting and prints, per
setting:

* mean seconds per image (wall clock of the whole ``generate`` call / images) and its speedup
  vs ``none``; denoise seconds (time inside the runner's denoising steps) and its speedup;
  denoise CPU seconds (the stepping thread's CPU time in those steps: on a machine other
  processes load, wall time counts the waits for a core, CPU time does not) and its speedup;
  encode seconds (prompt encoding, what the prompt cache saves);
* the fraction of request-steps whose transformer blocks were skipped;
* judge accuracy (the digit classifier of ``benchmarks/quality.py``; default model only);
* PSNR (dB, pixels in [0, 1], over all images), the worst single image's PSNR, and max abs
  pixel difference vs the ``none`` image of the same prompt and seed;
* the run-time guard's error estimate per request (quality levels; mean and max), and whether
  it singles out the images that break: the Spearman rank correlation between a request's
  final estimate and its image's error (``-PSNR``), and how many of the worst 5 % of images
  (by PSNR) are among the 5 % with the highest estimates.

``--plot PNG`` draws the speed/quality frontier (speedup vs PSNR over all pixels and of the
worst image, per setting; needs the ``bench`` extra: matplotlib).

Each prompt is used ``--repeats`` times with different seeds (repeated prompts, as in
serving), all requests are submitted at once (step-level batching, ``--max-batch-size`` rows).
Engine start-up (load, compile warm-up) and a full warm-up batch are excluded from the
timings; all engines are built first, then timed round-robin ``--trials`` times; the table
shows each setting's median trial and the spread (the prompt cache is warm after the first
trial; ``encode s`` shows it). The machine's load average is
printed: other processes on the CPU skew timings.

Usage::

    python benchmarks/acceleration.py                      # built-in digits model, 20 steps
    python benchmarks/acceleration.py --steps 50 --settings none teacache-0.3 cache_dit-F1-r0.25
    python benchmarks/acceleration.py --model DIR --prompt "a cat" --prompt "a dog"
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

#: name -> EngineConfig overrides. Thresholds were picked on the default model (teacache uses
#: its calibrated ``digits`` preset, see diffserve/acceleration/teacache.py); ``cache_dit-default``
#: is cache-dit's own DBCache defaults (Fn clamped to the model's 4 blocks: F3B0, 8 warm-up steps).
_CD_TUNED = {"Fn_compute_blocks": 1, "residual_diff_threshold": 0.25, "max_warmup_steps": 2}
SETTINGS: dict[str, dict] = {
    "none": {},
    "none-no-prompt-cache": {"prompt_embed_cache_size": 0},
    "teacache-0.2": {"cache_backend": "teacache", "cache_config": {"rel_l1_thresh": 0.2}},
    "teacache-0.3": {"cache_backend": "teacache", "cache_config": {"rel_l1_thresh": 0.3}},
    "teacache-0.6": {"cache_backend": "teacache", "cache_config": {"rel_l1_thresh": 0.6}},
    "cache_dit-default": {"cache_backend": "cache_dit"},
    "cache_dit-default-taylorseer": {"cache_backend": "cache_dit", "cache_config": {"taylorseer": True}},
    "cache_dit-F1-r0.25": {"cache_backend": "cache_dit", "cache_config": _CD_TUNED},
    "cache_dit-F1-r0.25-taylorseer": {"cache_backend": "cache_dit",
                                      "cache_config": {**_CD_TUNED, "taylorseer": True}},
    "compile": {"compile": True},
    "compile+teacache-0.3": {"compile": True, "cache_backend": "teacache",
                             "cache_config": {"rel_l1_thresh": 0.3}},
    # quality levels (SamplingParams.cache_quality, as the engine default): TaylorSeer forecasts
    # under the run-time guard; "unguarded-*" is the same level with the guard off.
    **{f"quality-{q}": {"cache_backend": "teacache", "cache_config": {"cache_quality": q}}
       for q in ("max", "high", "balanced", "fast")},
    **{f"unguarded-{q}": {"cache_backend": "teacache",
                          "cache_config": {"cache_quality": q, "levels": {q: {"budget": None}}}}
       for q in ("high", "balanced", "fast")},
    "compile+quality-fast": {"compile": True, "cache_backend": "teacache", "cache_config": {"cache_quality": "fast"}},
}


@dataclass
class Result:
    """One setting's measurements (seconds are totals over all images; one entry per trial,
    the table shows the median)."""

    name: str
    images: np.ndarray | None = None
    walls: list[float] = field(default_factory=list)
    denoises: list[float] = field(default_factory=list)
    denoise_cpus: list[float] = field(default_factory=list)
    encodes: list[float] = field(default_factory=list)
    skip_fraction: float = 0.0
    stats: dict | None = None
    error_estimates: list[float] = field(default_factory=list)

    @property
    def wall_s(self) -> float:
        return float(np.median(self.walls))

    @property
    def denoise_s(self) -> float:
        return float(np.median(self.denoises))

    @property
    def denoise_cpu_s(self) -> float:
        return float(np.median(self.denoise_cpus))

    @property
    def encode_s(self) -> float:
        return float(np.median(self.encodes))


class Setting:
    """An engine for one setting (`engine_args` + `overrides` as `EngineConfig` fields), built
    and warmed up with a full batch of short requests; `trial` times one generate call."""

    def __init__(self, name: str, overrides: dict, engine_args: dict, warm_requests: int,
                 params_fn) -> None:
        from diffserve import DiffusionEngine, EngineConfig

        self.result = Result(name)
        self.engine = DiffusionEngine(EngineConfig(**engine_args, **overrides))
        self.params_fn = params_fn
        self.timers = {"denoise": 0.0, "encode": 0.0, "denoise_cpu": 0.0}
        runner = self.engine.runner
        runner.step = self._timed(runner.step, "denoise")
        runner.prepare = self._timed(runner.prepare, "encode")  # prompt encoding dominates prepare
        self.engine.generate([f"warm-up {k}" for k in range(warm_requests)],
                             [params_fn(10**6 + k, 2) for k in range(warm_requests)])

    def _timed(self, fn, key):
        depth = [0]  # count the outermost call only (one request per forward): count the outer call

        def wrapper(*args, **kwargs):
            start, cpu = time.perf_counter(), time.thread_time()
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1
                if depth[0] == 0:
                    self.timers[key] += time.perf_counter() - start
                    if key == "denoise":  # the steps run on the calling thread: its CPU time
                        self.timers["denoise_cpu"] += time.thread_time() - cpu
        return wrapper

    def trial(self, prompts: list[str], seeds: list[int], steps: int) -> None:
        """Generate every prompt once and record the trial's timings."""
        r, runner = self.result, self.engine.runner
        before = runner.acceleration_stats()["cache_backend"]
        self.timers.update(denoise=0.0, encode=0.0, denoise_cpu=0.0)
        start = time.perf_counter()
        outputs = self.engine.generate(prompts, [self.params_fn(s, steps) for s in seeds])
        wall = time.perf_counter() - start
        failed = [o.error for o in outputs if not o.ok]
        if failed:
            raise RuntimeError(f"{r.name}: {len(failed)} requests failed, first: {failed[0]}")
        r.stats = runner.acceleration_stats()
        after = r.stats["cache_backend"]
        calls = after["transformer_calls"] - before["transformer_calls"]
        r.skip_fraction = (after["skipped"] - before["skipped"]) / calls if calls else 0.0
        r.images = np.stack([np.asarray(o.images)[0] for o in outputs]).astype(np.float64)
        r.error_estimates = [o.metrics.cache_error_estimate or 0.0 for o in outputs]
        r.walls.append(wall)
        r.denoises.append(self.timers["denoise"])
        r.denoise_cpus.append(self.timers["denoise_cpu"])
        r.encodes.append(self.timers["encode"])


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """PSNR in dB of images in [0, 1] over all pixels (inf when identical)."""
    mse = float(np.mean((a - b) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(1.0 / mse)


def psnr_per_image(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """PSNR in dB of each image pair (first axis) in [0, 1]; identical images give inf."""
    mse = ((a - b) ** 2).reshape(len(a), -1).mean(axis=1)
    with np.errstate(divide="ignore"):
        return 10 * np.log10(1.0 / mse)


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman rank correlation of two 1-D arrays (ranks by sorting; nan when either is constant)."""
    ra, rb = (np.argsort(np.argsort(x, kind="stable"), kind="stable").astype(np.float64) for x in (a, b))
    if ra.std() == 0 or rb.std() == 0 or np.ptp(a) == 0 or np.ptp(b) == 0:
        return math.nan
    return float(np.corrcoef(ra, rb)[0, 1])


def flagged_worst(estimates: np.ndarray, psnrs: np.ndarray, share: float = 0.05) -> tuple[int, int]:
    """How many of the `share` worst images (lowest PSNR) are among the `share` with the highest
    error estimates, and how many that is out of."""
    k = max(1, round(share * len(psnrs)))
    worst, flagged = set(np.argsort(psnrs, kind="stable")[:k]), set(np.argsort(-estimates, kind="stable")[:k])
    return len(worst & flagged), k


def _db(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x:.1f}"


def plot_frontier(rows: list[dict], path: str, title: str,
                  xlabel: str = "denoise speedup vs none (median of trials)") -> None:
    """The speed/quality frontier as a PNG: denoise speedup (x) vs PSNR (y) of the mean over
    all pixels (filled) and of the worst image (open), one labelled pair per setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    cap = 60.0  # identical images (inf dB) are drawn at the top
    for row in rows:
        x = row["denoise_speedup"]
        mean, worst = min(row["psnr"], cap), min(row["worst_psnr"], cap)
        color = "tab:blue" if row["name"].startswith(("quality", "compile+quality")) else (
            "tab:red" if row["name"].startswith("unguarded") else "tab:gray")
        ax.plot([x, x], [worst, mean], color=color, alpha=0.4)
        ax.scatter([x], [mean], color=color)
        ax.scatter([x], [worst], facecolors="none", edgecolors=color)
        ax.annotate(row["name"], (x, mean), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.axhline(30, color="k", lw=0.5, ls="--")
    ax.axhline(25, color="k", lw=0.5, ls=":")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("PSNR vs none, dB")
    ax.set_title(f"{title}\nfilled: PSNR over all pixels, open: worst image (inf drawn at {cap:g}); blue: guarded, "
                 "red: guard off", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


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
    parser.add_argument("--trials", type=int, default=3, help="timed runs per setting (median shown)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--load-format", default="default", choices=["default", "dummy"],
                        help="dummy: random weights from the folder's configs (timing only)")
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--cache-levels", default=None,
                        help="JSON {level: {field: value}} over the quality levels of every quality-/unguarded- setting")
    parser.add_argument("--plot", default=None, help="write the speed/quality frontier PNG here")
    parser.add_argument("--plot-cpu", action="store_true",
                        help="plot the denoise CPU-time speedup (the stepping thread's CPU seconds: robust on a "
                             "loaded machine) instead of the wall-clock one")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    labels = None
    if args.prompt is None:  # digit prompts, scored by the digit judge
        from quality import make_prompts  # puts the repository root (training/) on sys.path
        from training.digits import data

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
    from diffserve import SamplingParams

    def params(seed: int, n_steps: int) -> SamplingParams:
        return SamplingParams(seed=seed, num_inference_steps=n_steps, guidance_scale=args.guidance,
                              height=args.size, width=args.size, output_type="np")

    engine_args = dict(model=args.model, max_batch_size=args.max_batch_size, device=args.device,
                       dtype=args.dtype, load_format=args.load_format)
    warm = min(len(prompts), args.max_batch_size)
    chosen = {name: SETTINGS[name] for name in names}
    if args.cache_levels:
        import copy
        import json

        extra = json.loads(args.cache_levels)
        for name, overrides in chosen.items():
            if name.startswith(("quality", "unguarded", "compile+quality")):
                overrides = chosen[name] = copy.deepcopy(overrides)
                levels = overrides["cache_config"].setdefault("levels", {})
                for level, fields in extra.items():
                    levels[level] = {**fields, **levels.get(level, {})}
    settings = [Setting(name, chosen[name], engine_args, warm, params) for name in names]
    for t in range(args.trials):  # round-robin, so load changes hit every setting alike
        for setting in settings:
            setting.trial(prompts, seeds, args.steps)
            print(f"  trial {t + 1}: {setting.result.name} (best {setting.result.wall_s:.2f} s)", file=sys.stderr)
    results = [s.result for s in settings]
    base_r = results[0]
    n = len(prompts)
    print()
    print("| setting | s/image | speedup | denoise s (spread) | denoise speedup | denoise CPU s (spread) | "
          "denoise CPU speedup | encode s | skipped | judge acc | PSNR vs none | worst image PSNR | "
          "guard estimate mean / max | estimate vs error: Spearman, worst 5 % flagged | max abs diff |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    rows = []
    for r in results:
        accuracy = "-"
        if judge is not None:
            accuracy = f"{100 * np.mean(judge_images(judge, r.images) == labels):.1f} %"
        p = psnr(r.images, base_r.images)
        per_image = psnr_per_image(r.images, base_r.images)
        worst = float(np.min(per_image))
        estimates = np.asarray(r.error_estimates, dtype=np.float64)
        rho = spearman(estimates, -np.minimum(per_image, 1e3))
        hits, k = flagged_worst(estimates, per_image)
        ranking = "-" if math.isnan(rho) else f"{rho:+.2f}, {hits}/{k}"
        speedup = base_r.denoise_s / r.denoise_s
        cpu_speedup = base_r.denoise_cpu_s / r.denoise_cpu_s
        rows.append({"name": r.name, "denoise_speedup": cpu_speedup if args.plot_cpu else speedup, "psnr": p,
                     "worst_psnr": worst})
        spread = f"{min(r.denoises):.2f}-{max(r.denoises):.2f}"
        cpu_spread = f"{min(r.denoise_cpus):.2f}-{max(r.denoise_cpus):.2f}"
        print(f"| {r.name} | {r.wall_s / n:.4f} | {base_r.wall_s / r.wall_s:.2f}x | {r.denoise_s:.2f} ({spread}) | "
              f"{speedup:.2f}x | {r.denoise_cpu_s:.2f} ({cpu_spread}) | {cpu_speedup:.2f}x | "
              f"{r.encode_s:.3f} | {100 * r.skip_fraction:.1f} % | "
              f"{accuracy} | {_db(p)} dB | {_db(worst)} dB | "
              f"{np.mean(r.error_estimates):.4f} / {np.max(r.error_estimates):.4f} | {ranking} | "
              f"{np.abs(r.images - base_r.images).max():.4f} |")
    if args.plot:
        plot_frontier(rows, args.plot, f"{args.model or 'built-in digits'}: {len(prompts)} images, {args.steps} steps, "
                                       f"median of {args.trials} trials, {torch.get_num_threads()} thread(s)",
                      "denoise " + ("CPU-time " if args.plot_cpu else "") + "speedup vs none (median of trials)")
        print(f"\nfrontier plot: {args.plot}")
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
