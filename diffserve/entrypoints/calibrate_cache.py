"""``diffserve calibrate-cache --model DIR``: fit a model folder's step-caching calibration on
the model's own trajectories and write it into the folder (``DIR/diffserve_cache.json``), which
the engine then prefers over the family's built-in TeaCache table
(`diffserve.models.model_index.read_cache_calibration`).

What it fits, all through the engine (``--cache-backend teacache``, requests in shared step
batches):

1. **TeaCache's rescaling coefficients** (Liu et al. 2024, arXiv:2411.19108, Sec. 3.3): every
   prompt and seed runs uncached (level ``max``) with the backend recording, per step ``t >= 1``,
   ``x`` = relative L1 change of the modulated input and ``y`` = relative L1 change of the
   denoiser output (``mean|a_t - a_t-1| / mean|a_t-1|`` over a request's rows). A least-squares
   polynomial ``y ~ poly(x)`` (``numpy.polyfit``, highest degree first) is the fit. The same
   runs give the **residual magnitude curve** of magnitude forecasts (MagCache,
   arXiv:2506.09045): per step of the first ``--steps`` schedule, the mean log norm of the
   blocks' residual (`residual_log_norms`).
2. **The quality levels' budgets**: for each candidate budget ``b`` (``--budgets``) an engine whose
   ``high``, ``balanced`` and ``fast`` levels all have the guard budget ``b`` (and the fitted
   coefficients) runs every prompt and seed at the three levels; each output is compared with
   its uncached one (PSNR over all pixels of the level's outputs in [0, 1], and the worst single
   output). A level's budget is, among the candidates that (with every smaller one) keep its
   PSNR at or above the level's target (`TARGET_PSNR_DB`, the level's documented error budget)
   at every ``--steps`` count, the one that skips the most steps (`choose_budget`); when even
   the smallest misses it, budget 0 (the level never skips).

The file holds ``{"teacache": {"coefficients", "cache_quality": {level: {"budget"}}, "source"},
"calibration": {prompts, seeds, steps, points, rmse, targets, the PSNR and skipped share of every
candidate}}``. Prompts: ``--prompt`` (repeatable), else the built-in model's own
(`diffserve.models.BUILTIN_PROMPTS`), else `GENERIC_PROMPTS`; ``--num-prompts N`` takes the first
N (cycling). Models whose family has no TeaCache split are refused by name.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diffserve.core.errors import InvalidRequestError

#: Mean PSNR (dB, vs the uncached output, over all pixels) each level must keep on the
#: calibration trajectories: what the default levels give on the built-in model (README:
#: acceleration), rounded down.
TARGET_PSNR_DB: dict[str, float] = {"high": 40.0, "balanced": 35.0, "fast": 30.0}
#: Candidate guard budgets (the relative error estimate of `diffserve.acceleration.cache_guard`).
DEFAULT_BUDGETS = (0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3)
#: Prompts for a folder that is not a built-in model and gets no ``--prompt``.
GENERIC_PROMPTS = ("a photo of a cat sitting on a windowsill", "a red sports car on a mountain road",
                   "a bowl of fruit on a wooden table", "a watercolor painting of a lighthouse at sunset",
                   "a portrait of an old man with a white beard", "a city street at night in the rain",
                   "a snowy forest with a small wooden cabin", "an astronaut riding a horse on the moon",
                   "a plate of pasta with basil leaves", "a sailboat on a calm lake at dawn")
#: Bounds of the arguments.
MAX_PROMPTS, MAX_SEEDS, MAX_BUDGETS, MAX_DEGREE = 1000, 100, 20, 8


def add_calibrate_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``calibrate-cache`` options (model, prompts, seeds, steps, candidate budgets, fit
    degree, output file, device)."""
    parser.add_argument("--model", default=None, metavar="DIR|NAME",
                        help="the diffusers folder to calibrate, or a built-in model name (default: digits)")
    parser.add_argument("--prompt", action="append", default=None, metavar="TEXT",
                        help="a calibration prompt, repeatable (default: the built-in model's own prompts, "
                             "else ten generic ones)")
    parser.add_argument("--num-prompts", type=int, default=10, metavar="N",
                        help=f"prompts used, 1-{MAX_PROMPTS}: the first N of the list, cycled")
    parser.add_argument("--seeds", type=int, default=2, metavar="N", help=f"seeds 0..N-1 per prompt, 1-{MAX_SEEDS}")
    parser.add_argument("--steps", type=int, nargs="+", default=None, metavar="S",
                        help="step counts to calibrate on, each >= 2 (default: the model's)")
    parser.add_argument("--budgets", type=float, nargs="+", default=list(DEFAULT_BUDGETS), metavar="B",
                        help=f"candidate guard budgets, each finite and > 0, at most {MAX_BUDGETS}")
    parser.add_argument("--degree", type=int, default=4, metavar="D",
                        help=f"degree of the rescaling polynomial, 1-{MAX_DEGREE}")
    parser.add_argument("--output", default=None, metavar="FILE",
                        help="where to write the calibration (default: DIR/diffserve_cache.json)")
    parser.add_argument("--device", default="auto", help="auto (cuda if available, else cpu), cpu, cuda or cuda:N")
    parser.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16"],
                        help="weights and activations dtype; auto = bf16 on cuda, fp32 on cpu")
    parser.add_argument("--max-batch-size", type=int, default=16, metavar="ROWS",
                        help="most transformer rows per denoising step")
    parser.add_argument("--threads", type=int, default=None, metavar="N",
                        help="torch intra-op threads (default: torch's, one per core)")


@dataclass(frozen=True)
class CalibrationPlan:
    """A checked ``calibrate-cache`` run.

    Attributes:
        model_dir: the folder calibrated.
        prompts: the calibration prompts (each run with every seed).
        seeds: seeds per prompt (0..seeds-1).
        steps: step counts (None: the model's default).
        budgets: candidate guard budgets, ascending.
        degree: degree of the rescaling polynomial.
        output: the file written.
    """

    model_dir: Path
    prompts: tuple[str, ...]
    seeds: int
    steps: tuple[int, ...] | None
    budgets: tuple[float, ...]
    degree: int
    output: Path


def check_arguments(args: argparse.Namespace) -> CalibrationPlan:
    """Every check that needs no model.

    Raises:
        InvalidRequestError: naming the field (the flag's dest): a count out of range, a
            budget that is not finite and > 0, a step count < 2, an empty prompt, a model
            folder that does not exist, an output that is a folder or in a missing one.
    """
    from diffserve.core.sampling_params import RequestLimits, validate_prompt
    from diffserve.models import BUILTIN_PROMPTS, builtin_name, resolve_model
    from diffserve.models.model_index import CACHE_CALIBRATION, read_model_index

    if not 1 <= args.num_prompts <= MAX_PROMPTS:
        raise InvalidRequestError("num_prompts", args.num_prompts, f"an integer in [1, {MAX_PROMPTS}]")
    if not 1 <= args.seeds <= MAX_SEEDS:
        raise InvalidRequestError("seeds", args.seeds, f"an integer in [1, {MAX_SEEDS}]")
    max_steps = RequestLimits().max_num_inference_steps
    for s in args.steps or ():
        if not 2 <= s <= max_steps:
            raise InvalidRequestError("steps", s, f"integers in [2, {max_steps}]")
    if not 1 <= len(args.budgets) <= MAX_BUDGETS or not all(math.isfinite(b) and b > 0 for b in args.budgets):
        raise InvalidRequestError("budgets", " ".join(f"{b:g}" for b in args.budgets),
                                  f"1 to {MAX_BUDGETS} finite numbers > 0")
    if not 1 <= args.degree <= MAX_DEGREE:
        raise InvalidRequestError("degree", args.degree, f"an integer in [1, {MAX_DEGREE}]")
    for prompt in args.prompt or ():
        if not prompt.strip():
            raise InvalidRequestError("prompt", prompt, "a non-empty text")
        validate_prompt(prompt)
    model_dir = resolve_model(args.model)
    read_model_index(model_dir)  # UnsupportedModelError: no such folder, or not a diffusers folder
    name = builtin_name(args.model)
    base = tuple(args.prompt or BUILTIN_PROMPTS.get(name or "", GENERIC_PROMPTS))
    prompts = tuple(base[i % len(base)] for i in range(args.num_prompts))
    output = Path(args.output) if args.output is not None else model_dir / CACHE_CALIBRATION
    if output.is_dir() or not output.parent.is_dir():  # else a traceback after the whole run
        raise InvalidRequestError("output", str(output), "a file path in an existing folder")
    steps = tuple(dict.fromkeys(args.steps)) if args.steps else None  # each count once, first one first
    return CalibrationPlan(model_dir, prompts, args.seeds, steps,
                           tuple(sorted(set(args.budgets))), args.degree, output)


def fit_coefficients(x, y, degree: int) -> tuple[list[float], float]:
    """Least-squares polynomial ``y ~ poly(x)`` (``numpy.polyfit``).

    Args:
        x, y: 1-D float arrays of equal length (> `degree`): relative L1 changes of the
            modulated input and of the denoiser output.
        degree: the polynomial's degree.

    Returns:
        The coefficients (highest degree first) and the fit's root-mean-square residual.

    Raises:
        InvalidRequestError: (field ``steps``) fewer points than coefficients.
    """
    import numpy as np

    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if len(x) <= degree:
        raise InvalidRequestError("steps", len(x), f"enough steps for more than {degree} points (more prompts, "
                                  "seeds or steps)")
    coefficients = np.polyfit(x, y, degree)
    rmse = float(np.sqrt(np.mean((y - np.polyval(coefficients, x)) ** 2)))
    return [float(c) for c in coefficients], rmse


def residual_log_norms(records: list, num_steps: int) -> list[float]:
    """The model's residual magnitude curve for magnitude (MagCache) forecasts: per step of the
    `num_steps` schedule, the mean over the uncached requests of ``log`` of the mean per-token
    L2 norm of the blocks' residual.

    Args:
        records: ``[num_steps, step, log norm]`` triples (the backend's ``residual_norms``).
        num_steps: the schedule the curve is taken from.

    Raises:
        InvalidRequestError: (field ``steps``) a step of that schedule has no record.
    """
    import numpy as np

    by_step: dict[int, list[float]] = {}
    for n, step, value in records:
        if int(n) == num_steps:
            by_step.setdefault(int(step), []).append(float(value))
    if sorted(by_step) != list(range(num_steps)):
        raise InvalidRequestError("steps", num_steps, "a schedule every calibration request ran in full")
    return [float(np.mean(by_step[k])) for k in range(num_steps)]


def choose_budget(candidates: list[tuple[float, float, float]], target_db: float) -> float:
    """The budget of the level: among the budgets whose PSNR, and that of every smaller
    budget, is >= `target_db`, the one that skips the most steps (the smallest of equals: a
    larger budget that skips no more only loosens the guard on outliers).

    Args:
        candidates: (budget, PSNR in dB: the lowest over the step counts, share of steps
            skipped) triples, any order.
        target_db: the level's target.

    Returns:
        That budget, or 0.0 (never skip) when the smallest budget misses the target.
    """
    chosen, most = 0.0, -1.0
    for budget, psnr, skipped in sorted(candidates):
        if not psnr >= target_db:  # NaN misses too
            break
        if skipped > most:
            chosen, most = budget, skipped
    return chosen


def psnr_db(a, b) -> float:
    """PSNR in dB of outputs in [0, 1] over all their pixels (inf when identical)."""
    import numpy as np

    mse = float(np.mean((np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(1.0 / mse)


def _pixels(output) -> Any:
    """A finished output's pixels (images, or a video's frames) as one float array."""
    import numpy as np

    if not output.ok:
        raise RuntimeError(f"a calibration request failed: {output.error}")
    return np.asarray(output.videos[0] if output.videos else output.images, dtype=np.float64)


def _engine(plan: CalibrationPlan, args: argparse.Namespace, cache_config: dict):
    from diffserve.config import EngineConfig
    from diffserve.engine.client import DiffusionEngine

    config = EngineConfig(model=str(plan.model_dir), cache_backend="teacache", cache_config=cache_config,
                          device=args.device, dtype=args.dtype, max_batch_size=args.max_batch_size,
                          num_threads=args.threads)
    try:
        return DiffusionEngine(config)
    except InvalidRequestError as exc:
        if exc.field == "cache_backend":
            from diffserve.models.model_index import read_model_index

            pipeline = read_model_index(plan.model_dir).get("_class_name", "its pipeline")
            raise InvalidRequestError("model", str(plan.model_dir), "a model whose family supports step caching "
                                      f"(--cache-backend teacache; {pipeline} here has no TeaCache split)") from None
        raise


def _jobs(plan: CalibrationPlan, steps: tuple[int, ...]) -> list[tuple[str, int, int]]:
    return [(prompt, seed, s) for s in steps for prompt in plan.prompts for seed in range(plan.seeds)]


def _params(seed: int, steps: int, level: str):
    from diffserve.core.sampling_params import SamplingParams

    return SamplingParams(seed=seed, num_inference_steps=steps, output_type="np", cache_quality=level)


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def calibrate(plan: CalibrationPlan, args: argparse.Namespace, log=print) -> dict[str, Any]:
    """Run the calibration of `plan` (see the module docstring) and return the file's content.

    Raises:
        InvalidRequestError: the model's family has no TeaCache split (field ``model``), or too
            few points for the fit (field ``steps``).
        RuntimeError: a calibration request failed.
    """
    import numpy as np

    engine = _engine(plan, args, {"record_changes": True})
    try:
        steps = plan.steps or (engine.spec.default_num_inference_steps,)
        jobs = _jobs(plan, steps)
        outputs = engine.generate([p for p, _, _ in jobs], [_params(seed, s, "max") for _, seed, s in jobs])
        reference = {job: _pixels(out) for job, out in zip(jobs, outputs)}
        recorded = engine.stats()["acceleration"]["cache_backend"]
        changes = np.asarray(recorded["changes"], dtype=np.float64)
        log_norms = residual_log_norms(recorded["residual_norms"], steps[0])
    finally:
        engine.shutdown()
    coefficients, rmse = fit_coefficients(changes[:, 0], changes[:, 1], plan.degree)
    log(f"coefficients: {len(changes)} points, degree {plan.degree}, rmse {rmse:.4f}")
    levels = list(TARGET_PSNR_DB)
    candidates = []
    for budget in plan.budgets:
        engine = _engine(plan, args, {"coefficients": coefficients,
                                      "levels": {level: {"budget": budget} for level in levels}})
        try:  # the three levels' requests share step batches
            runs = [(level, job) for level in levels for job in jobs]
            outputs = engine.generate([job[0] for _, job in runs], [_params(job[1], job[2], level) for level, job in runs])
        finally:
            engine.shutdown()
        row: dict[str, Any] = {"budget": budget}
        for level in levels:
            per_steps = {}
            for s in steps:
                pairs = [(_pixels(out), reference[job], out.metrics.cache_skipped_steps)
                         for (lv, job), out in zip(runs, outputs) if lv == level and job[2] == s]
                per_steps[s] = {
                    "psnr_db": psnr_db(np.stack([a for a, _, _ in pairs]), np.stack([b for _, b, _ in pairs])),
                    "worst_psnr_db": min(psnr_db(a, b) for a, b, _ in pairs),
                    "skipped": sum(k for _, _, k in pairs) / (s * len(pairs)),
                }
            row[level] = {str(s): {k: _finite(v) for k, v in v_.items()} for s, v_ in per_steps.items()}
            row[level]["_min_psnr_db"] = min(v["psnr_db"] for v in per_steps.values())
            row[level]["_skipped"] = sum(v["skipped"] for v in per_steps.values()) / len(per_steps)
        log(f"budget {budget:g}: " + ", ".join(
            f"{level} {row[level]['_min_psnr_db']:.1f} dB" for level in levels))
        candidates.append(row)
    chosen = {level: choose_budget([(r["budget"], r[level]["_min_psnr_db"], r[level]["_skipped"])
                                    for r in candidates], TARGET_PSNR_DB[level]) for level in levels}
    for row in candidates:
        for level in levels:
            del row[level]["_min_psnr_db"], row[level]["_skipped"]
    source = (f"diffserve calibrate-cache: {len(plan.prompts)} prompts x {plan.seeds} seeds x steps "
              f"{list(steps)}, {len(changes)} points, degree {plan.degree}, rmse {rmse:.4f}; budgets: the "
              "candidate skipping most while keeping mean PSNR vs uncached >= " +
              ", ".join(f"{level} {TARGET_PSNR_DB[level]:g} dB" for level in levels))
    return {
        "teacache": {"coefficients": coefficients,
                     "cache_quality": {level: {"budget": chosen[level]} for level in levels},
                     "residual_log_norms": log_norms, "source": source},
        "calibration": {"prompts": list(plan.prompts), "seeds": plan.seeds, "steps": list(steps),
                        "points": len(changes), "x_range": [float(changes[:, 0].min()), float(changes[:, 0].max())],
                        "rmse": rmse, "degree": plan.degree, "targets_psnr_db": TARGET_PSNR_DB,
                        "candidates": candidates},
    }


def run(args: argparse.Namespace) -> int:
    """``diffserve calibrate-cache``: check, calibrate, write the file, print its path; 0."""
    plan = check_arguments(args)
    from diffserve.core.library_warnings import silence_inapplicable_library_warnings

    silence_inapplicable_library_warnings()
    result = calibrate(plan, args, log=lambda line: print(line, flush=True))
    plan.output.write_text(json.dumps(result, indent=2) + "\n")
    budgets = result["teacache"]["cache_quality"]
    print("budgets: " + ", ".join(f"{level} {v['budget']:g}" for level, v in budgets.items()))
    print(plan.output)
    return 0
