"""StableDiffusionXLPipeline quirks: ``force_zeros_for_empty_prompt`` (zero negative embeddings
without a negative prompt, or "" encoded when the folder says so) equal to diffusers, regional
compile of the UNet's transformer blocks, defaults, dummy weights, CLI. (Parity with two text encoders and
pooled + time-id micro-conditioning, nested added_cond_kwargs collated across requests, refusals,
cache-backend refusals: tests/conformance/.)"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from diffusers import StableDiffusionXLPipeline

from diffserve import DiffusionEngine, EngineConfig, SamplingParams
from diffserve.entrypoints.cli import main
from seeds import image_generators

TOL = 1e-4
PARITY = 1e-6  # measured: 0.0 for every case below


@pytest.fixture(scope="module")
def engine(tiny_sdxl_dir):
    return DiffusionEngine(EngineConfig(model=str(tiny_sdxl_dir), max_batch_size=16))


def _p(seed, steps=3, guidance=5.0, **kw):
    return SamplingParams(seed=seed, num_inference_steps=steps, guidance_scale=guidance, output_type="np", **kw)


def _run(engine, prompt, params):
    [out] = engine.generate(prompt, params)
    assert out.ok, out.error
    return out


def _diffusers(folder, prompt, params: SamplingParams):
    pipe = StableDiffusionXLPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    return pipe(prompt, negative_prompt=params.negative_prompt, num_images_per_prompt=params.num_images_per_prompt,
                num_inference_steps=params.num_inference_steps, guidance_scale=params.guidance_scale,
                height=params.height, width=params.width, generator=image_generators(params.seed, params.num_images_per_prompt),
                output_type="np").images


@pytest.mark.parametrize("steps,guidance,n,negative,size", [(4, 6.0, 1, None, (64, 64))],
                         ids=["cfg-zero-negative"])
def test_matches_diffusers(tiny_sdxl_dir, engine, steps, guidance, n, negative, size):
    params = _p(7, steps, guidance, num_images_per_prompt=n, negative_prompt=negative, height=size[0], width=size[1])
    out = _run(engine, "a photo of a cat", params)
    ref = _diffusers(tiny_sdxl_dir, "a photo of a cat", params)
    assert out.images.shape == ref.shape == (n, *size, 3)
    assert np.abs(out.images - ref).max() <= PARITY
    assert out.metrics.batch_sizes == {n * (2 if guidance > 1 else 1): steps}


def test_force_zeros_for_empty_prompt_follows_the_folder(tiny_sdxl_dir, engine, tmp_path):
    """With ``force_zeros_for_empty_prompt`` false in model_index.json, a request without a
    negative prompt encodes "" (as diffusers), which changes the image."""
    folder = shutil.copytree(tiny_sdxl_dir, tmp_path / "sdxl")
    index = json.loads((folder / "model_index.json").read_text())
    assert index["force_zeros_for_empty_prompt"] is True
    (folder / "model_index.json").write_text(json.dumps({**index, "force_zeros_for_empty_prompt": False}))
    params = _p(3, steps=2)
    out = _run(DiffusionEngine(EngineConfig(model=str(folder))), "a cat", params)
    assert np.abs(out.images - _diffusers(folder, "a cat", params)).max() <= PARITY
    assert np.abs(out.images - _run(engine, "a cat", params).images).max() > 1e-3


def test_regional_compile_of_the_unet_transformer_blocks(tiny_sdxl_dir, engine):
    """diffusers declares UNet2DConditionModel._repeated_blocks = ["BasicTransformerBlock"]:
    compiled outputs equal eager ones, and after the warm-up (64 px: 16 tokens = 16 channels
    in the attention blocks) other resolutions and batch sizes do not recompile."""
    compiled = DiffusionEngine(EngineConfig(model=str(tiny_sdxl_dir), compile=True, max_batch_size=4))
    jobs = [("a", _p(1, steps=2)), ("b", _p(2, steps=3, guidance=1.0)),
            ("c", _p(3, steps=2, num_images_per_prompt=3, height=48, width=80)), ("d", _p(4, steps=2, height=128))]
    outs = compiled.generate([j[0] for j in jobs], [j[1] for j in jobs])
    for out, job in zip(outs, jobs):
        assert out.ok, out.error
        assert np.abs(out.images - _run(engine, *job).images).max() <= TOL
    stats = compiled.runner.acceleration_stats()["compile"]
    assert stats["enabled"] and stats["graphs_compiled"] >= 1
    assert stats["recompiles_after_warmup"] == 0


def test_spec_defaults(engine):
    spec = engine.spec
    # default_sample_size (unet sample_size 8) x 8; real SDXL base: 128 x 8 = 1024
    assert (spec.default_height, spec.default_width, spec.resolution_factor) == (64, 64, 8)
    assert (spec.default_num_inference_steps, spec.default_guidance_scale) == (50, 5.0)


def test_dummy_weights_and_cli(tiny_sdxl_dir, tmp_path, capsys):
    [out] = DiffusionEngine(EngineConfig(model=str(tiny_sdxl_dir), load_format="dummy")).generate(
        "a cat", _p(1, steps=2, height=32, width=32))
    assert out.ok and out.images.shape == (1, 32, 32, 3)
    rc = main(["generate", "--model", str(tiny_sdxl_dir), "--prompt", "a cat", "--steps", "2", "--size", "32x48",
               "--seed", "4", "-o", str(tmp_path)])
    assert rc == 0, capsys.readouterr().err
    from PIL import Image

    [path] = capsys.readouterr().out.split()
    assert Image.open(path).size == (32, 48)
