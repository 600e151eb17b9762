"""Running a registry model's requests on the engine and on diffusers' own pipeline, and comparing
what comes out, with failure messages that name the model, the check and the largest difference.

Everything here goes through the public API (`DiffusionEngine`, `EngineConfig`,
`SamplingParams`, `GenerationOutput`, events) except `runner_request_ids`, the one look inside
the engine (what the model runner still holds).
"""

from __future__ import annotations

import importlib
import json
import os
from typing import Any

import numpy as np
import torch
from PIL import Image
from seeds import image_generators, per_image
from tiny_models.registry import TestModel, uint8_levels

#: A request batched with others vs alone: float noise only (NOTES: <= 5e-6 measured).
BATCH_TOL = 1e-4
PROMPT = "a red apple on a wooden table"


def input_image(model: TestModel, seed: int = 0, size: tuple[int, int] | None = None) -> Image.Image:
    """A seeded random input image of `model.input_size` (width, height): RGB, or grayscale for
    one-channel models."""
    width, height = size or model.input_size
    rng = np.random.default_rng(seed)
    if model.channels == 1:
        return Image.fromarray(rng.integers(0, 256, (height, width), dtype=np.uint8), mode="L")
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def request_image(model: TestModel, seed: int = 0) -> Image.Image | None:
    """The input image every request of an edit model needs (None for the others)."""
    return input_image(model, seed) if model.images == "required" else None


def media(out) -> np.ndarray | torch.Tensor:
    """A finished output's media as one array: images (N, H, W, C) as returned, videos stacked
    (N, F, H, W, 3) (uint8 for np; latents stay tensors)."""
    assert out.ok, f"request {out.request_id} {out.status}: {out.error}"
    if out.videos:
        first = out.videos[0]
        return torch.stack(out.videos) if isinstance(first, torch.Tensor) else np.stack(out.videos)
    return out.images


def as_float(x) -> np.ndarray:
    """Pixels or latents as float64 numpy; uint8 pixels scaled to [0, 1]."""
    if isinstance(x, torch.Tensor):
        x = x.detach().float().cpu().numpy()
    x = np.asarray(x)
    return x.astype(np.float64) / 255 if x.dtype == np.uint8 else x.astype(np.float64)


def max_difference(actual, expected) -> float:
    """max |actual - expected| over every element (pixels in [0, 1] units)."""
    a, b = as_float(actual), as_float(expected)
    assert a.shape == b.shape, f"shapes differ: {a.shape} vs {b.shape}"
    return float(np.abs(a - b).max()) if a.size else 0.0


#: Environment variable naming a file to which every comparison appends one JSON line
#: ``{"model", "check", "max_difference", "atol"}`` (the measured margins, for reports).
REPORT_ENV = "DIFFSERVE_CONFORMANCE_REPORT"


def assert_close(model: TestModel, check: str, actual, expected, atol: float) -> float:
    """Assert max |actual - expected| <= atol; the message names the model, the check and the
    difference seen (also in uint8 levels). Returns the difference."""
    a, b = as_float(actual), as_float(expected)
    assert a.shape == b.shape, f"{model.id}: {check}: shape {a.shape} != expected {b.shape}"
    diff = np.abs(a - b)
    worst = float(diff.max()) if diff.size else 0.0
    if os.environ.get(REPORT_ENV):
        with open(os.environ[REPORT_ENV], "a") as report:
            report.write(json.dumps({"model": model.id, "check": check, "max_difference": worst, "atol": atol}) + "\n")
    if not worst <= atol:  # (also catches NaN)
        where = np.unravel_index(int(np.nanargmax(diff)), diff.shape) if np.isfinite(diff).any() else "?"
        raise AssertionError(f"{model.id}: {check}: max |difference| {worst:.3g} "
                             f"({uint8_levels(worst):.2f} uint8 levels) > {atol:.3g}, at index {where}")
    return worst


def run(engine, prompt: str, params, image=None):
    """One request on its own; its finished `GenerationOutput`."""
    [out] = engine.generate(prompt, params, inputs=image)
    assert out.ok, f"{prompt!r}: {out.status}: {out.error}"
    return out


def run_events(engine, prompt: str, params, image=None, **add_kwargs) -> list:
    """Add one request and step the (otherwise idle) engine until it is done; its events."""
    request_id = engine.add_request(prompt, params, inputs=image, **add_kwargs)
    events = []
    while engine.has_unfinished_requests():
        events += [e for e in engine.step() if e.request_id == request_id]
    return events


#: Loaded diffusers pipelines by (folder, class name): each is loaded once per session.
_REFERENCE_PIPELINES: dict[tuple[str, str], Any] = {}


def sampler_scheduler(pipe, name: str):
    """The scheduler diffusers runs for sampler `name` on `pipe`: the documented table's class
    and overrides (`diffserve.pipelines.samplers.SAMPLERS`) applied to the folder's config, as
    a diffusers user swaps ``pipe.scheduler``."""
    import diffusers

    from diffserve.pipelines.samplers import FLOW_PREDICTION, SAMPLERS, prediction_type

    sampler = SAMPLERS[name]
    class_name, overrides = sampler.flow if prediction_type(pipe.scheduler) == FLOW_PREDICTION else sampler.noise
    config = dict(pipe.scheduler.config)
    overrides = overrides(config) if callable(overrides) else overrides
    return getattr(diffusers, class_name).from_config(config, **overrides)


def diffusers_reference(model: TestModel, folder, prompt: str, params, image=None, cls: str | None = None,
                        pipe=None, **call: Any):
    """diffusers' own pipeline ``__call__`` on `folder` with the request's resolved `params`
    (every field the family uses, the same seed; ``params.scheduler`` swapped in with
    `sampler_scheduler` for this call; `call`: further ``__call__`` arguments): images
    (N, H, W, C) or frames (N, F, H, W, 3), float in [0, 1]. `pipe`: an already loaded pipeline
    to call (e.g. with LoRA adapters set)."""
    cls = cls or model.reference
    if pipe is None:
        pipe = _REFERENCE_PIPELINES.get((str(folder), cls))
    if pipe is None:
        diffusers = importlib.import_module("diffusers")
        pipe = getattr(diffusers, cls).from_pretrained(folder, **model.reference_load(folder))
        pipe.set_progress_bar_config(disable=True)
        _REFERENCE_PIPELINES[(str(folder), cls)] = pipe
    kwargs: dict[str, Any] = dict(
        prompt=prompt, negative_prompt=params.negative_prompt, num_inference_steps=params.num_inference_steps,
        height=params.height, width=params.width,
        generator=image_generators(params.seed, params.num_images_per_prompt), output_type="np")
    kwargs["num_videos_per_prompt" if model.video else "num_images_per_prompt"] = params.num_images_per_prompt
    for name in ("guidance_scale", "true_cfg_scale", "guidance_scale_2", "max_sequence_length", "num_frames"):
        if name in model.fields:
            kwargs[name] = getattr(params, name)
    if image is not None:
        kwargs["image"] = image
        if "strength" in model.fields:
            kwargs["strength"] = params.strength
    kwargs.update(model.reference_call(params))
    kwargs.update(call)
    folder_scheduler = pipe.scheduler
    if getattr(params, "scheduler", None) is not None:
        pipe.scheduler = sampler_scheduler(pipe, params.scheduler)
    try:
        if image is not None and "strength" in model.fields and params.num_images_per_prompt > 1:
            # diffusers' img2img draws image i's input-latent sample from generator 0 (it encodes
            # the input once and repeats it); diffserve draws all of image i from seed + i
            kwargs["num_images_per_prompt"] = 1
            return per_image(lambda generator: pipe(**{**kwargs, "generator": generator}).images, params.seed,
                             params.num_images_per_prompt)
        out = pipe(**kwargs)
    finally:
        pipe.scheduler = folder_scheduler  # the pipeline is shared: the next reference runs the folder's
    return out.frames if model.video else out.images


def reference_pipeline(model: TestModel, folder, cls: str | None = None):
    """diffusers' pipeline of `model` (its reference class, or `cls`) loaded from `folder`."""
    diffusers = importlib.import_module("diffusers")
    pipe = getattr(diffusers, cls or model.reference).from_pretrained(folder, **model.reference_load(folder))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def runner_request_ids(engine) -> set[str]:
    """Ids of the requests whose state (latents, embeddings, diffusion scheduler) the engine's
    in-process model runner still holds."""
    runner = engine.runner
    return set(runner.states) | set(runner.streams)
