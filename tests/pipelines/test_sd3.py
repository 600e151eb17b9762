"""diffserve's images equal diffusers' own StableDiffusion3Pipeline for the same inputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import StableDiffusion3Pipeline

from diffserve import DiffusionEngine, EngineConfig, SamplingParams


def _reference(folder, prompt, *, steps, guidance, seed, n=1, negative=None, t5=False):
    kwargs = {} if t5 else {"text_encoder_3": None, "tokenizer_3": None}
    pipe = StableDiffusion3Pipeline.from_pretrained(folder, **kwargs)
    pipe.set_progress_bar_config(disable=True)
    return pipe(
        prompt,
        negative_prompt=negative,
        num_images_per_prompt=n,
        num_inference_steps=steps,
        guidance_scale=guidance,
        height=64,
        width=64,
        generator=torch.Generator().manual_seed(seed),
        output_type="np",
    ).images


@pytest.mark.parametrize(
    "steps,guidance,n,negative",
    [(4, 1.0, 1, None), (4, 5.0, 1, None), (1, 5.0, 1, None), (1, 1.0, 1, None), (3, 3.0, 2, "blurry")],
    ids=["no-cfg", "cfg", "cfg-1-step", "no-cfg-1-step", "cfg-n2-negative"],
)
def test_matches_diffusers(engine, tiny_sd3_dir, steps, guidance, n, negative):
    prompt = "a photo of a cat"
    [out] = engine.generate(
        prompt,
        SamplingParams(num_inference_steps=steps, guidance_scale=guidance, seed=7,
                       num_images_per_prompt=n, negative_prompt=negative, output_type="np"),
    )
    ref = _reference(tiny_sd3_dir, prompt, steps=steps, guidance=guidance, seed=7, n=n, negative=negative)
    assert out.images.shape == ref.shape == (n, 64, 64, 3)
    assert np.abs(out.images - ref).max() <= 1e-4
    # exactly one denoiser pass per step; CFG doubles the rows of that pass
    assert out.metrics.num_steps == steps
    assert out.metrics.batch_sizes == {n * (2 if guidance > 1 else 1): steps}


def test_matches_diffusers_with_t5(tiny_sd3_t5_dir):
    engine = DiffusionEngine(EngineConfig(model=str(tiny_sd3_t5_dir)))
    [out] = engine.generate("a red bicycle", SamplingParams(num_inference_steps=3, guidance_scale=4.0,
                                                            seed=11, output_type="np"))
    ref = _reference(tiny_sd3_t5_dir, "a red bicycle", steps=3, guidance=4.0, seed=11, t5=True)
    assert np.abs(out.images - ref).max() <= 1e-4


def test_pil_output_matches_np(engine):
    params = dict(num_inference_steps=2, guidance_scale=1.0, seed=3)
    [pil] = engine.generate("a dog", SamplingParams(**params))
    [arr] = engine.generate("a dog", SamplingParams(**params, output_type="np"))
    assert pil.images[0].size == (64, 64)
    assert np.array_equal(np.asarray(pil.images[0]), (arr.images[0] * 255).round().astype(np.uint8))
