"""Training pieces shared by the built-in models' trainers (``digits`` and ``digits-video``).

Both built-in models are trained the same way, on CPU, in two phases under one wall-clock
budget: first the VAE (Adam, cosine decay, :func:`train_vae`), then the denoiser and its text
encoder(s) jointly (AdamW, linear warm-up then cosine decay, EMA of the weights,
:func:`train_denoiser`). What differs per model (the pipeline, the data, the loss) is passed in
as callables; this module holds the optimisation loop, its loss logging, the command-line
arguments and output steps common to both ``train.py`` scripts, and the model-card helpers.

Loss curves are lists of ``(step, mean loss over the log interval)`` pairs; steps count from 1.
Deadlines are ``time.monotonic()`` values in seconds.

Random numbers come from seeded generators in a fixed order (see :func:`seed_everything` and
:func:`train_denoiser`), so a rerun with the same flags reproduces the same weights.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import torch

#: Markers around the model card's judge section, filled in by ``benchmarks/quality*.py --update-card``.
QUALITY_BEGIN = "<!-- quality:begin -->"
QUALITY_END = "<!-- quality:end -->"

Curve = list[tuple[int, float]]


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Optimisation settings common to the built-in models; each model's ``train.TrainConfig``
    subclasses it with the defaults used for its shipped weights (and fields of its own).

    Wall-clock cap ``minutes`` for the whole run; ``max_steps`` denoiser steps (also the length
    of the LR schedule) of ``batch_size`` examples; ``vae_steps`` VAE steps of
    ``vae_batch_size`` examples; a loss-curve point every ``log_every`` steps.
    """

    seed: int = 0
    threads: int = 1
    max_steps: int = 3000
    minutes: float
    batch_size: int
    lr: float = 1e-3
    weight_decay: float = 0.01
    warmup_steps: int = 200
    ema_decay: float = 0.999
    empty_prompt_prob: float = 0.1
    vae_steps: int = 800
    vae_lr: float = 2e-3
    vae_batch_size: int
    vae_kl_weight: float = 1e-3
    log_every: int = 100


# --- schedules -------------------------------------------------------------------------------


def cosine_decay(step: int, total_steps: int) -> float:
    """Learning-rate factor decaying from 1 to 0 along half a cosine over ``total_steps``, then 0.

    Raises:
        ZeroDivisionError: if ``total_steps`` is 0.
    """
    return 0.5 * (1 + math.cos(math.pi * min(step, total_steps) / total_steps))


def warmup_cosine(step: int, warmup_steps: int, max_steps: int) -> float:
    """Learning-rate factor: linear warm-up ``(step + 1) / warmup_steps`` for the first
    ``warmup_steps`` steps, then half a cosine from 1 to 0 over the remaining steps, then 0.

    ``step`` is the scheduler's count (0 before the first optimiser step).
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, max_steps - warmup_steps)
    return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


# --- loops -----------------------------------------------------------------------------------


def run_steps(
    step_fn: Callable[[int], float],
    num_steps: int,
    log_every: int,
    deadline: float,
    log_line: Callable[[int, float], str],
    budget_prefix: str = "",
) -> tuple[Curve, int]:
    """Call ``step_fn(step)`` for ``step = 1 .. num_steps``, logging the mean loss it returns.

    Every ``log_every`` steps (and at the last step) the mean of the losses since the previous
    log point is appended to the curve and ``log_line(step, mean)`` is printed. After any step
    past ``deadline`` the loop stops, appending the mean of the not yet logged losses, if any.

    Returns:
        ``(curve, steps done)``; ``([], 0)`` when ``num_steps`` is 0.
    """
    curve: Curve = []
    running: list[float] = []
    step = 0
    for step in range(1, num_steps + 1):
        running.append(step_fn(step))
        if step % log_every == 0 or step == num_steps:
            curve.append((step, float(np.mean(running))))
            print(log_line(step, curve[-1][1]), flush=True)
            running = []
        if time.monotonic() > deadline:
            print(f"{budget_prefix}wall-clock budget reached at step {step}", flush=True)
            if running:
                curve.append((step, float(np.mean(running))))
            break
    return curve, step


def train_vae(
    vae: torch.nn.Module,
    batch_loss: Callable[[], torch.Tensor],
    config: TrainConfig,
    deadline: float,
    log_every: int | None = None,
    clip_grad_norm: float | None = None,
) -> Curve:
    """Train ``vae`` in place: Adam (lr ``config.vae_lr``) with :func:`cosine_decay` over
    ``config.vae_steps`` steps; stops early at ``deadline``. Leaves ``vae`` in eval mode.

    Args:
        batch_loss: draws a fresh batch and returns its scalar loss (called once per step).
        log_every: steps per loss-curve point (default ``config.log_every``).
        clip_grad_norm: clip the gradient's total norm to this value (None: no clipping).

    Returns:
        The loss curve (``(step, interval mean loss)`` pairs).
    """
    optimizer = torch.optim.Adam(vae.parameters(), lr=config.vae_lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: cosine_decay(s, config.vae_steps))
    vae.train()

    def step_fn(step: int) -> float:
        loss = batch_loss()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(vae.parameters(), clip_grad_norm)
        optimizer.step()
        schedule.step()
        return loss.item()

    curve, _ = run_steps(
        step_fn, config.vae_steps, log_every or config.log_every, deadline,
        lambda step, loss: f"vae step {step:5d}  loss {loss:.5f}", budget_prefix="vae: ",
    )
    vae.eval()
    return curve


def train_denoiser(
    modules: Sequence[torch.nn.Module],
    num_examples: int,
    batch_loss: Callable[[torch.Tensor, random.Random, torch.Generator], torch.Tensor],
    config: TrainConfig,
    deadline: float,
) -> tuple[Curve, int]:
    """Train ``modules`` jointly; leaves the exponential moving average of their weights in them.

    AdamW (lr ``config.lr``, ``config.weight_decay``) with :func:`warmup_cosine` over
    ``config.max_steps``; gradient norm clipped to 1.0; EMA decay
    ``min(config.ema_decay, (1 + s) / (10 + s))`` at step ``s``. Batches of
    ``config.batch_size`` example indices are drawn without replacement from a random
    permutation of ``range(num_examples)``, reshuffled when fewer than a batch remain. Stops
    early at ``deadline``. Leaves ``modules`` in eval mode.

    Random numbers: a ``torch.Generator`` seeded ``config.seed + 1`` draws the permutations and
    is passed to ``batch_loss`` (for ``t`` and the noise); a ``random.Random(config.seed + 2)``
    is passed to ``batch_loss`` for the prompts.

    Args:
        batch_loss: ``(indices, prompt_rng, generator) -> scalar loss`` for the examples at
            ``indices`` (int64 (batch_size,) on CPU).

    Returns:
        ``(loss curve, steps done)``.
    """
    params = [p for m in modules for p in m.parameters()]
    ema = [p.detach().clone() for p in params]
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: warmup_cosine(s, config.warmup_steps, config.max_steps)
    )
    generator = torch.Generator().manual_seed(config.seed + 1)
    prompt_rng = random.Random(config.seed + 2)
    for m in modules:
        m.train()

    order = torch.randperm(num_examples, generator=generator)
    cursor = 0

    def step_fn(step: int) -> float:
        nonlocal order, cursor
        if cursor + config.batch_size > len(order):
            order, cursor = torch.randperm(num_examples, generator=generator), 0
        idx = order[cursor : cursor + config.batch_size]
        cursor += config.batch_size
        loss = batch_loss(idx, prompt_rng, generator)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        with torch.no_grad():
            decay = min(config.ema_decay, (1 + step) / (10 + step))
            torch._foreach_lerp_(ema, [p.detach() for p in params], 1 - decay)
        return loss.item()

    curve, steps = run_steps(
        step_fn, config.max_steps, config.log_every, deadline,
        lambda step, loss: f"step {step:6d}  loss {loss:.4f}  lr {schedule.get_last_lr()[0]:.2e}",
    )
    with torch.no_grad():
        for p, e in zip(params, ema):
            p.copy_(e)
    for m in modules:
        m.eval()
    return curve, steps


# --- command line and output -----------------------------------------------------------------


def add_run_arguments(parser: argparse.ArgumentParser, defaults: type[TrainConfig]) -> None:
    """Add ``--out``, ``--seed`` and ``--minutes`` (defaults from the model's ``TrainConfig`` class)."""
    parser.add_argument("--out", type=Path, required=True, help="output pipeline folder")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--minutes", type=float, default=defaults.minutes,
                        help="wall-clock cap for the whole run (training stops early when reached)")


def add_card_argument(parser: argparse.ArgumentParser) -> None:
    """Add ``--card`` (see :func:`model_card_path`)."""
    parser.add_argument("--card", type=Path, default=None,
                        help="model card path (default: the package MODEL_CARD.md when --out is the "
                        "built-in weights folder, else OUT/MODEL_CARD.md)")


def build_config(config_cls: type[TrainConfig], args: argparse.Namespace, tiny: dict, **overrides: Any) -> Any:
    """The ``config_cls`` (a :class:`TrainConfig` subclass) for parsed ``args``.

    Sets ``seed``, ``threads`` and ``minutes`` from ``args``; then ``tiny`` when ``args.tiny``;
    then each of ``overrides`` that is not None; then, when ``args.max_steps`` is given,
    ``max_steps`` and ``warmup_steps = min(default warm-up, max(1, max_steps // 10))``.
    """
    values = {"seed": args.seed, "threads": args.threads, "minutes": args.minutes}
    if args.tiny:
        values.update(tiny)
    values.update({k: v for k, v in overrides.items() if v is not None})
    if args.max_steps is not None:
        values["max_steps"] = args.max_steps
        values["warmup_steps"] = min(config_cls.warmup_steps, max(1, args.max_steps // 10))
    return config_cls(**values)


def seed_everything(config: TrainConfig) -> None:
    """``torch.set_num_threads(config.threads)`` and seed Python's, NumPy's and torch's global RNGs."""
    torch.set_num_threads(config.threads)
    random.seed(config.seed)
    np.random.seed(config.seed)
    torch.manual_seed(config.seed)


def save_pipeline(pipe: Any, out: Path, generation_defaults: dict) -> Path:
    """Save ``pipe`` (safetensors) to ``out`` and write its sampling defaults to
    ``generation_config.json``, which diffserve reads as the model's defaults.

    Returns:
        ``out`` resolved to an absolute path (created if missing).
    """
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(out, safe_serialization=True)
    (out / "generation_config.json").write_text(json.dumps(generation_defaults, indent=2) + "\n")
    return out


def model_card_path(card: Path | None, out: Path, default_weights_dir: Path, package_card: Path) -> Path:
    """``card`` if given; else ``package_card`` when ``out`` is the built-in weights folder,
    else ``out / "MODEL_CARD.md"``."""
    return card or (package_card if out == default_weights_dir else out / "MODEL_CARD.md")


def command_line(module: str, argv: list[str] | None) -> str:
    """The command that reproduces this run: ``python -m MODULE ARGS`` (``sys.argv`` when
    ``argv`` is None), shell-quoted, for the model card."""
    return f"python -m {module} " + shlex.join(sys.argv[1:] if argv is None else argv)


# --- model card ------------------------------------------------------------------------------


def count_parameters(module: torch.nn.Module) -> int:
    """Number of scalar parameters of ``module``."""
    return sum(p.numel() for p in module.parameters())


def component_parameters(pipe: Any, names: Iterable[str] = ("transformer", "text_encoder", "vae")) -> dict[str, int]:
    """``{name: count_parameters(pipe.<name>)}`` for the named pipeline components."""
    return {name: count_parameters(getattr(pipe, name)) for name in names}


def folder_bytes(path: Path) -> int:
    """Total size in bytes of the files under ``path``."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def loss_table(curve: Curve, rows: int = 20) -> str:
    """Markdown table of about ``rows`` evenly spaced points of ``curve`` (always with its last
    point); ``"No steps in this run."`` for an empty curve."""
    if not curve:
        return "No steps in this run."
    stride = max(1, len(curve) // rows)
    picked = curve[::stride]
    if picked[-1] != curve[-1]:
        picked.append(curve[-1])
    lines = ["| step | loss (interval mean) |", "|---:|---:|"]
    lines += [f"| {s} | {l:.4f} |" for s, l in picked]
    return "\n".join(lines)
