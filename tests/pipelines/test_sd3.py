"""StableDiffusion3Pipeline quirks: a folder with a T5 encoder equals diffusers (parity, batching,
refusals, events and cache backends of every family: tests/conformance/)."""

from __future__ import annotations

import numpy as np
import torch
from diffusers import StableDiffusion3Pipeline

from diffserve import DiffusionEngine, EngineConfig, SamplingParams


def test_matches_diffusers_with_t5(tiny_sd3_t5_dir):
    engine = DiffusionEngine(EngineConfig(model=str(tiny_sd3_t5_dir)))
    [out] = engine.generate("a red bicycle", SamplingParams(num_inference_steps=3, guidance_scale=4.0,
                                                            seed=11, output_type="np"))
    pipe = StableDiffusion3Pipeline.from_pretrained(tiny_sd3_t5_dir)
    pipe.set_progress_bar_config(disable=True)
    ref = pipe("a red bicycle", num_inference_steps=3, guidance_scale=4.0, height=64, width=64,
               generator=torch.Generator().manual_seed(11), output_type="np").images
    assert np.abs(out.images - ref).max() <= 1e-4
