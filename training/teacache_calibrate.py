"""Fit TeaCache's rescaling polynomial for a model (TeaCache, arXiv:2411.19108, Sec. 3.3).

For uncached generations of some prompts and seeds, every step ``t >= 1`` gives one point:

* ``x`` = relative L1 change of the timestep-modulated input (what TeaCache can see cheaply),
* ``y`` = relative L1 change of the transformer output (what skipping a step gets wrong),

both ``mean|a_t - a_{t-1}| / mean|a_{t-1}|`` over a request's rows. A least-squares polynomial
``y ~ poly(x)`` (``numpy.polyfit``, highest degree first) is TeaCache's rescaling function.

Usage::

    python -m training.teacache_calibrate                 # built-in digits model
    python -m training.teacache_calibrate --model DIR --prompt "a cat" --prompt "a dog"

Prints the coefficients as JSON; pass them as ``cache_config={"coefficients": [...]}``
(``--cache-config '{"coefficients": [...]}'``).
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import torch

from diffserve.acceleration.teacache import relative_l1


def collect(model: str | None, prompts: list[str], seeds: list[int], steps: list[int],
            guidance: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Run uncached requests; returns (x, y) float64 arrays, one point per step >= 1.

    Raises:
        InvalidRequestError: the model's adapter declares no TeaCache split.
    """
    from diffserve.config import EngineConfig
    from diffserve.core.errors import InvalidRequestError
    from diffserve.pipelines.base import RequestState
    from diffserve.runner.model_runner import ModelRunner
    from diffserve.core.sampling_params import SamplingParams

    config = EngineConfig(model=model, prompt_embed_cache_size=0)
    runner = ModelRunner(config)
    adapter = runner.adapter
    support = adapter.capabilities.teacache
    if support is None:
        raise InvalidRequestError("model", model, f"a model with a TeaCache split ({adapter.pipeline_class_name} has none)")
    xs, ys = [], []
    for n in steps:
        for prompt in prompts:
            for seed in seeds:
                params = SamplingParams(seed=seed, num_inference_steps=n, guidance_scale=guidance,
                                        output_type="latent").resolve(adapter.spec, config.limits, 0)
                state = RequestState(f"calib-{seed}", prompt, params)
                previous = None
                with torch.inference_mode():
                    adapter.prepare(state)
                    while not state.done:
                        batch = adapter.collate([state])
                        seen = {}

                        def call(b, kwargs):
                            seen["modulated"] = support.split.embed(adapter.denoiser, kwargs)[2]
                            return adapter.call_denoiser(b, kwargs)

                        out = adapter.denoise(batch, call=call)
                        modulated = seen["modulated"]
                        if previous is not None:
                            xs.append(relative_l1(modulated, previous[0]))
                            ys.append(relative_l1(out, previous[1]))
                        previous = (modulated, out)
                        adapter.step(batch, adapter.combine(batch, out))
    return np.asarray(xs), np.asarray(ys)


def fit(x: np.ndarray, y: np.ndarray, degree: int = 4) -> list[float]:
    """Least-squares polynomial coefficients (highest degree first) of y ~ poly(x)."""
    return [float(c) for c in np.polyfit(x, y, degree)]


def main(argv: list[str] | None = None) -> int:
    """Command line (see the module docstring); prints the fit as JSON, returns 0."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="diffusers folder (default: built-in digits model)")
    parser.add_argument("--prompt", action="append", default=None,
                        help="repeatable (default: one digit prompt per digit)")
    parser.add_argument("--seeds", type=int, default=4, help="seeds 0..N-1 per prompt")
    parser.add_argument("--steps", type=int, nargs="+", default=[20, 50], help="step counts to sample")
    parser.add_argument("--guidance", type=float, default=None, help="guidance scale (model default)")
    parser.add_argument("--degree", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    prompts = args.prompt
    if prompts is None:  # one digit prompt per digit (for digits models)
        from training.digits import data

        prompts = [data.format_prompt(data.TRAIN_TEMPLATES[d % len(data.TRAIN_TEMPLATES)], d)
                   for d in range(10)]
    x, y = collect(args.model, prompts, list(range(args.seeds)), args.steps, args.guidance)
    coefficients = fit(x, y, args.degree)
    residual = y - np.polyval(coefficients, x)
    print(json.dumps({
        "coefficients": coefficients,
        "points": len(x),
        "x_range": [float(x.min()), float(x.max())],
        "rmse": float(np.sqrt(np.mean(residual**2))),
        "prompts": len(prompts), "seeds": args.seeds, "steps": args.steps,
    }, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
