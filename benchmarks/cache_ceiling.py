"""Ceilings of step skipping on the built-in digits model (issue 31): what a fixed set of
computed steps can reach, whatever the engine's overhead and guard do.

A reference loop, outside the engine, over diffusers' own components: ``StableDiffusion3Pipeline``
loaded from the built-in folder, classifier-free guidance (``--guidance``, the model's 4.0), the
folder's ``FlowMatchEulerDiscreteScheduler`` sigmas, and a latent Euler step
``x += (sigma_{i+1} - sigma_i) * v``. At a computed step the transformer runs on both guidance
rows; at a skipped one its output is forecast by the order-1 Newton/Taylor expansion in the
timestep through the last two computed outputs (TaylorSeer, arXiv:2503.06923; the engine's
``taylor`` forecast, `diffserve.acceleration.forecast`). Every number is PSNR (dB, decoded
pixels in [0, 1]) against the same loop with every step computed, mean over all pixels and of
the worst image: deterministic, no timing.

Experiments (``--experiment``):

* ``search``: a local search over the computed set of ``--computed`` size (first and warm-up
  steps kept): moves one free step by -2..+2 while the mean PSNR improves; prints every set
  tried. With 7 of 20 steps computed (the most that allows a 2.5x denoise speedup, see the
  README) it shows the best reachable mean PSNR of this forecast.
* ``corrector``: a UniPC-style corrector (Zhao et al. 2023, arXiv:2302.04867, its UniC step,
  here over a skipped window): at a computed step after skips, the window's forecasts are
  replaced by the interpolation through the newly computed output (Newton order
  ``1`` or ``2``) and the latent gets the difference of the Euler updates. Variants: the
  computed output kept as is (``plain``); moved to the corrected latent by a first-order model
  of the denoiser (``x0``: the data prediction ``x - sigma v`` held fixed, so ``v += dx /
  sigma``; ``eps``: the noise prediction ``x + (1 - sigma) v`` held fixed); or recomputed at the
  corrected latent (``reeval``: one more forward per window, an upper bound that costs more
  than it saves).
* ``trip``: a guard acting at check steps: a request whose summed window deviation (below)
  passes ``--thresholds`` computes every later step. Threshold 0 trips every request at its
  first check, i.e. only the first skipped window is skipped: the best any check-step guard can
  do for the worst image.
* ``rank``: whether signals available at check steps rank the images the cache breaks: the
  window deviation (the relative L2 size of the latent correction above, ``|dx| / |x|``: the
  forecast's measured error integrated over the window, free at a check step) and a
  sensitivity probe (one more forward at ``x + eps * |x| * dx / |dx|``: the guided output's
  response per unit of perturbation), each against the image's error (``-PSNR``): Spearman
  rank correlation and how many of the worst 5 % are among its top 5 %.

Usage::

    python benchmarks/cache_ceiling.py --experiment search --images 40
    python benchmarks/cache_ceiling.py --experiment corrector --images 40 --computed-set 0,1,2,6,11,16,19
    python benchmarks/cache_ceiling.py --experiment trip --images 200 --computed-set 0,1,2,6,10,14,18,19 \\
        --thresholds inf,0
    python benchmarks/cache_ceiling.py --experiment rank --images 200 --computed-set 0,1,2,6,10,14,18,19
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from diffserve.acceleration.forecast import Forecaster  # noqa: E402
from diffserve.models import BUILTIN_PROMPTS, resolve_model  # noqa: E402


class ReferenceLoop:
    """CFG + flow-matching Euler over the built-in model's diffusers components, with step
    skipping by order-1 Taylor forecasts of the transformer output.

    Args:
        images: number of images (prompt ``k % 10`` of the digit prompts, seed ``k``).
        steps: num_inference_steps.
        guidance: guidance_scale.
    """

    def __init__(self, images: int, steps: int, guidance: float):
        from diffusers import StableDiffusion3Pipeline

        self.pipe = StableDiffusion3Pipeline.from_pretrained(
            resolve_model("digits"), text_encoder_3=None, tokenizer_3=None)
        prompts = [BUILTIN_PROMPTS["digits"][k % 10] for k in range(images)]
        with torch.no_grad():
            pe, npe, ppe, nppe = self.pipe.encode_prompt(prompts, prompts, prompts, negative_prompt="",
                                                         do_classifier_free_guidance=True, device="cpu")
        self.embeds, self.pooled = torch.cat([npe, pe]), torch.cat([nppe, ppe])
        size = self.pipe.transformer.config.sample_size
        self.latents = torch.cat([torch.randn(1, self.pipe.transformer.config.in_channels, size, size,
                                              generator=torch.Generator().manual_seed(k)) for k in range(images)])
        self.pipe.scheduler.set_timesteps(steps)
        self.timesteps = [float(t) for t in self.pipe.scheduler.timesteps]
        self.sigmas = [float(s) for s in self.pipe.scheduler.sigmas]
        self.steps, self.guidance, self.images = steps, guidance, images
        self.reference = self.decode(self.run(set(range(steps)))[0])

    def model(self, x: torch.Tensor, i: int) -> torch.Tensor:
        """Transformer output at step `i` for both guidance rows: (2 x images, C, H, W),
        unconditional rows first."""
        with torch.no_grad():
            return self.pipe.transformer(hidden_states=torch.cat([x, x]),
                                         timestep=torch.full((2 * len(x),), self.timesteps[i]),
                                         encoder_hidden_states=self.embeds, pooled_projections=self.pooled,
                                         return_dict=False)[0]

    def guide(self, out: torch.Tensor) -> torch.Tensor:
        """The guided prediction ``uncond + guidance * (cond - uncond)`` of a (2 x images, C, H, W)
        output: (images, C, H, W), its dtype (float32)."""
        uncond, cond = out.chunk(2)
        return uncond + self.guidance * (cond - uncond)

    @staticmethod
    def newton(history: list[tuple[float, torch.Tensor]], t: float, order: int) -> torch.Tensor:
        """The engine's forecast (`diffserve.acceleration.forecast.Forecaster`, Newton divided
        differences) at timestep `t` through the newest ``order + 1`` points of `history`
        ((timestep, output) pairs, oldest first): an extrapolation past the newest point, an
        interpolation inside; a tensor of the outputs' shape and dtype."""
        return Forecaster.fit(history, order).predict(t)

    def run(self, computed: set[int], corrector: str | None = None, corrector_order: int = 1,
            trip: float = math.inf, probe_eps: float = 0.0):
        """One pass over the schedule, computing the steps in `computed` (and, for a request
        whose summed window deviation passed `trip`, every later step).

        Args:
            computed: indices of the computed steps (the others are forecast).
            corrector: None, ``"plain"``, ``"x0"``, ``"eps"`` or ``"reeval"`` (module docstring).
            corrector_order: Newton order of the corrector's interpolation (1 or 2).
            trip: summed window deviation past which a request computes every later step.
            probe_eps: > 0: run the sensitivity probe at each check step, a perturbation of this
                fraction of the latent's L2 norm.

        Returns:
            (final latents (images, C, H, W) float32; per check step ``(step, window deviation
            (images,) float32 numpy, probe gain (images,) float32 numpy or None)``; the share of
            request-steps skipped, in [0, 1]).
        """
        x, history, window = self.latents.clone(), [], []
        tripped = torch.zeros(self.images, dtype=torch.bool)
        deviation = torch.zeros(self.images)
        checks, skipped = [], 0.0
        for i in range(self.steps):
            t = self.timesteps[i]
            if i in computed or tripped.any():
                computed_out = self.model(x, i)
            if i in computed:
                out = computed_out
                if window:
                    dx = 0.0
                    for j, forecast in window:
                        interp = self.newton(history + [(t, out)], self.timesteps[j], corrector_order)
                        dx = dx + (self.sigmas[j + 1] - self.sigmas[j]) * (self.guide(interp) - self.guide(forecast))
                    size = x.flatten(1).norm(dim=1)
                    dev = dx.flatten(1).norm(dim=1) / size
                    gain = None
                    if probe_eps:
                        direction = dx / dx.flatten(1).norm(dim=1).clamp_min(1e-12).view(-1, 1, 1, 1)
                        delta = direction * (probe_eps * size).view(-1, 1, 1, 1)
                        gain = ((self.guide(self.model(x + delta, i)) - self.guide(out)).flatten(1).norm(dim=1)
                                / delta.flatten(1).norm(dim=1)).numpy()
                    checks.append((i, dev.numpy(), gain))
                    deviation += dev
                    tripped |= deviation > trip
                    if corrector:
                        x = x + dx
                        rows = torch.cat([dx, dx])
                        if corrector == "reeval":
                            out = self.model(x, i)
                        elif corrector == "x0":
                            out = out + rows / self.sigmas[i]
                        elif corrector == "eps":
                            out = out - rows / (1.0 - self.sigmas[i])
                history.append((t, out))
                window = []
            else:
                forecast = self.newton(history, t, 1)
                window.append((i, forecast))
                if tripped.any():
                    out = torch.where(torch.cat([tripped, tripped]).view(-1, 1, 1, 1), computed_out, forecast)
                else:
                    out = forecast
                skipped += float((~tripped).float().mean())
            x = x + (self.sigmas[i + 1] - self.sigmas[i]) * self.guide(out)
        return x, checks, skipped / self.steps

    def decode(self, latents: torch.Tensor) -> np.ndarray:
        vae = self.pipe.vae
        with torch.no_grad():
            image = vae.decode(latents / vae.config.scaling_factor + vae.config.shift_factor, return_dict=False)[0]
        return (image / 2 + 0.5).clamp(0, 1).numpy()

    def psnr(self, latents: torch.Tensor) -> np.ndarray:
        """Per-image PSNR (dB) of decoded `latents` against the all-computed reference."""
        mse = ((self.decode(latents) - self.reference) ** 2).reshape(self.images, -1).mean(axis=1)
        with np.errstate(divide="ignore"):
            return 10 * np.log10(1.0 / mse)


def summary(psnrs: np.ndarray) -> str:
    """"mean X dB  worst image Y dB" of per-image PSNRs (dB); the mean is over all pixels (of the
    per-image MSEs), as `benchmarks/acceleration.py` reports it."""
    mean = 10 * math.log10(1.0 / float(np.mean(10 ** (-psnrs / 10))))
    return f"mean {mean:6.2f} dB  worst image {psnrs.min():6.2f} dB"


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman rank correlation of two 1-D arrays of equal length."""
    ra, rb = (np.argsort(np.argsort(v, kind="stable"), kind="stable").astype(float) for v in (a, b))
    return float(np.corrcoef(ra, rb)[0, 1])


def flagged(signal: np.ndarray, psnrs: np.ndarray) -> str:
    """How well `signal` (per image, larger = worse expected) ranks the images by error
    (``-psnrs``): Spearman, and how many of the worst 5 % are among its top 5 %."""
    k = max(1, round(0.05 * len(psnrs)))
    worst, top = set(np.argsort(psnrs)[:k]), set(np.argsort(-signal)[:k])
    return f"Spearman {spearman(signal, -psnrs):+.2f}, {len(worst & top)}/{k} of the worst"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked: exits with a usage error naming the flag (status 2) when
    ``--images`` / ``--steps`` is below 1, ``--computed-set`` is not integer steps in
    ``[0, steps - 1]`` including 0, or ``--thresholds`` is not comma-separated numbers >= 0."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experiment", choices=("search", "corrector", "trip", "rank"), required=True)
    ap.add_argument("--images", type=int, default=40, help="images: prompt k %% 10, seed k")
    ap.add_argument("--steps", type=int, default=20, help="num_inference_steps")
    ap.add_argument("--guidance", type=float, default=4.0, help="guidance_scale")
    ap.add_argument("--computed-set", default="0,1,2,6,11,16,19", help="computed steps, comma-separated")
    ap.add_argument("--thresholds", default="inf,0", help="trip: summed window deviations, comma-separated")
    ap.add_argument("--probe-eps", type=float, default=0.05, help="rank: perturbation, relative to |x|")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    for flag, value in (("--images", args.images), ("--steps", args.steps)):
        if value < 1:
            ap.error(f"argument {flag}: invalid value {value}: must be an integer >= 1")
    try:
        args.computed = sorted(int(s) for s in args.computed_set.split(","))
    except ValueError:
        args.computed = []
    if not args.computed or args.computed[0] != 0 or args.computed[-1] >= args.steps:
        ap.error(f"argument --computed-set: invalid value {args.computed_set!r}: integer steps in "
                 f"[0, {args.steps - 1}] including 0")
    try:
        args.threshold_values = [float(s) for s in args.thresholds.split(",")]
    except ValueError:
        args.threshold_values = [-1.0]
    if any(not t >= 0 for t in args.threshold_values):
        ap.error(f"argument --thresholds: invalid value {args.thresholds!r}: comma-separated numbers >= 0 "
                 "(inf allowed)")
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    computed = args.computed
    print("command: python benchmarks/cache_ceiling.py " + shlex.join(sys.argv[1:]))
    loop = ReferenceLoop(args.images, args.steps, args.guidance)

    def score(steps) -> np.ndarray:
        return loop.psnr(loop.run(set(steps))[0])

    if args.experiment == "search":
        warmup = next((k for k in range(len(computed)) if computed[k] != k), len(computed))  # leading 0, 1, ...
        best, best_psnr = tuple(computed), score(computed)
        print(f"{best}: {summary(best_psnr)}", flush=True)
        seen, improved = {best}, True
        while improved:
            improved = False
            for slot in range(warmup, len(best)):
                for move in (-2, -1, 1, 2):
                    candidate = list(best)
                    candidate[slot] += move
                    candidate = tuple(sorted(set(candidate)))
                    if (len(candidate) != len(best) or candidate[-1] >= args.steps or candidate in seen
                            or candidate[:warmup] != best[:warmup]):
                        continue
                    seen.add(candidate)
                    psnrs = score(candidate)
                    print(f"{candidate}: {summary(psnrs)}", flush=True)
                    if np.mean(10 ** (-psnrs / 10)) < np.mean(10 ** (-best_psnr / 10)):
                        best, best_psnr, improved = candidate, psnrs, True
        print(f"best of {len(seen)} sets: {best}: {summary(best_psnr)}")
    elif args.experiment == "corrector":
        print(f"forecast only: {summary(score(computed))}", flush=True)
        for mode in ("plain", "x0", "eps", "reeval"):
            for order in (1, 2):
                x = loop.run(set(computed), corrector=mode, corrector_order=order)[0]
                print(f"corrector {mode:6s} order {order}: {summary(loop.psnr(x))}", flush=True)
    elif args.experiment == "trip":
        for threshold in args.threshold_values:
            x, _, skipped = loop.run(set(computed), trip=threshold)
            print(f"trip at summed deviation > {threshold}: {summary(loop.psnr(x))}, "
                  f"{100 * skipped:.1f} % of steps skipped", flush=True)
    else:
        x, checks, _ = loop.run(set(computed), probe_eps=args.probe_eps)
        psnrs = loop.psnr(x)
        print(f"unguarded: {summary(psnrs)}")
        total = np.zeros(args.images)
        for step, dev, gain in checks:
            total = total + dev
            print(f"check step {step:2d}: window deviation {flagged(dev, psnrs)}; summed so far "
                  f"{flagged(total, psnrs)}; probe gain (median {np.median(gain):.2f}) {flagged(gain, psnrs)}")


if __name__ == "__main__":
    main()
