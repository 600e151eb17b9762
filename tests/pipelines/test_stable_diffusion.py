"""StableDiffusionPipeline (SD 1.x / 2.x layout) quirks: parity with diffusers for each classic
scheduler and both prediction types, per-request scheduler state (multistep history, ancestral
noise) inside mixed step batches, the safety checker, defaults, CLI (regional compile of the
UNet's transformer blocks: tests/pipelines/test_stable_diffusion_xl.py, same block class). The
PNDM folder's parity, batching, refusals and cache-backend refusals: tests/conformance/."""

from __future__ import annotations

import json
import logging
import shutil

import numpy as np
import pytest
import torch
from diffusers import StableDiffusionPipeline
from tiny_models import build_tiny_sd15

from diffserve import DiffusionEngine, EngineConfig, SamplingParams
from diffserve.entrypoints.cli import main
from seeds import image_generators

TOL = 1e-4
PARITY = 1e-6  # measured: 0.0 for every case below


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tiny_sd15_dir):
    """Tiny SD folders by (scheduler, prediction_type), built on first use."""
    built = {("PNDMScheduler", "epsilon"): tiny_sd15_dir}

    def get(scheduler="PNDMScheduler", prediction="epsilon"):
        key = (scheduler, prediction)
        if key not in built:
            built[key] = build_tiny_sd15(tmp_path_factory.mktemp(f"sd15_{scheduler}_{prediction}"),
                                         scheduler=scheduler, prediction_type=prediction)
        return built[key]

    return get


@pytest.fixture(scope="module")
def engines(folders):
    cache = {}

    def get(scheduler="PNDMScheduler", prediction="epsilon"):
        key = (scheduler, prediction)
        if key not in cache:
            cache[key] = DiffusionEngine(EngineConfig(model=str(folders(*key)), max_batch_size=16))
        return cache[key]

    return get


def _p(seed, steps=3, guidance=5.0, **kw):
    return SamplingParams(seed=seed, num_inference_steps=steps, guidance_scale=guidance, output_type="np", **kw)


def _run(engine, prompt, params):
    [out] = engine.generate(prompt, params)
    assert out.ok, out.error
    return out


def _diffusers(folder, prompt, params: SamplingParams):
    pipe = StableDiffusionPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    return pipe(prompt, negative_prompt=params.negative_prompt, num_images_per_prompt=params.num_images_per_prompt,
                num_inference_steps=params.num_inference_steps, guidance_scale=params.guidance_scale,
                height=params.height, width=params.width, generator=image_generators(params.seed, params.num_images_per_prompt),
                output_type="np").images


# ------------------------------------------------------------------------------- parity
@pytest.mark.parametrize("steps,guidance,n,negative", [(4, 6.0, 1, None)], ids=["cfg-4-steps"])
def test_pndm_matches_diffusers(folders, engines, steps, guidance, n, negative):
    """SD 1.5's default scheduler: PNDM (PLMS) with skip_prk_steps runs N + 1 UNet passes."""
    params = _p(7, steps, guidance, num_images_per_prompt=n, negative_prompt=negative, height=64, width=64)
    out = _run(engines(), "a photo of a cat", params)
    ref = _diffusers(folders(), "a photo of a cat", params)
    assert out.images.shape == ref.shape == (n, 64, 64, 3)
    assert np.abs(out.images - ref).max() <= PARITY
    passes = steps + 1 if steps > 1 else 1
    assert out.metrics.batch_sizes == {n * (2 if guidance > 1 else 1): passes}


@pytest.mark.parametrize("scheduler,prediction", [
    ("EulerDiscreteScheduler", "v_prediction"),
    ("EulerAncestralDiscreteScheduler", "epsilon"),
    ("DDIMScheduler", "v_prediction"),
    ("DPMSolverMultistepScheduler", "epsilon"),
])
def test_each_scheduler_and_prediction_type_matches_diffusers(folders, engines, scheduler, prediction):
    params = _p(11, steps=4, guidance=5.0, negative_prompt="dark", height=48, width=64)
    out = _run(engines(scheduler, prediction), "a red bicycle", params)
    ref = _diffusers(folders(scheduler, prediction), "a red bicycle", params)
    assert out.images.shape == (1, 48, 64, 3)
    assert np.abs(out.images - ref).max() <= PARITY
    assert out.metrics.batch_sizes == {2: 4}


def test_outputs_depend_on_seed_prompt_and_ancestral_noise(engines):
    """The tiny model is not degenerate: seed and prompt change the image, and Euler ancestral
    really draws its per-step noise from the request's generator (a deterministic Euler run
    from the same initial latents differs)."""
    engine = engines()
    base = _run(engine, "a cat", _p(1)).images
    assert np.abs(base - _run(engine, "a cat", _p(2)).images).max() > 1e-2
    assert np.abs(base - _run(engine, "a ship", _p(1)).images).max() > 1e-3
    ancestral = _run(engines("EulerAncestralDiscreteScheduler"), "a cat", _p(1)).images
    euler = _run(engines("EulerDiscreteScheduler"), "a cat", _p(1)).images
    assert np.abs(ancestral - euler).max() > 1e-2


# ------------------------------------------------------------------------------ batching
@pytest.mark.parametrize("scheduler", ["EulerAncestralDiscreteScheduler", "DPMSolverMultistepScheduler"])
def test_batch_invariance_with_per_request_scheduler_state(engines, scheduler):
    """Three requests with different prompts, negative prompts, seeds, step counts and CFG
    weights share forwards; each keeps its own scheduler state (PNDM / DPM-Solver history,
    Euler-ancestral noise from its own generator) and equals its solo run."""
    engine = engines(scheduler)
    jobs = [("a lighthouse at dusk", _p(5, steps=4, guidance=3.0)),
            ("a bowl of fruit", _p(9, steps=2, guidance=7.5, negative_prompt="blurry")),
            ("snowy mountains", _p(13, steps=6, guidance=5.0, num_images_per_prompt=2))]
    outs = engine.generate([j[0] for j in jobs], [j[1] for j in jobs])
    for (prompt, params), out in zip(jobs, outs):
        assert out.ok, out.error
        assert np.abs(out.images - _run(engine, prompt, params).images).max() <= TOL
    assert max(outs[0].metrics.batch_sizes) == 8  # 4 images x 2 CFG rows in one forward


# -------------------------------------------------------------------------- safety checker
def _with_safety_checker(folder, out, flag_everything: bool):
    """A copy of `folder` with a tiny `StableDiffusionSafetyChecker` + `CLIPImageProcessor`
    (as the real SD 1.5 folders have); with `flag_everything` its concept thresholds are below
    any cosine similarity, so every image is flagged."""
    from diffusers.pipelines.stable_diffusion.safety_checker import StableDiffusionSafetyChecker
    from transformers import CLIPConfig, CLIPImageProcessor

    torch.manual_seed(0)
    small = dict(hidden_size=16, intermediate_size=16, num_attention_heads=2, num_hidden_layers=1)
    checker = StableDiffusionSafetyChecker(CLIPConfig(
        text_config=small, vision_config=dict(**small, image_size=32, patch_size=8), projection_dim=8)).eval()
    if flag_everything:
        checker.concept_embeds_weights.data.fill_(-2.0)
    pipe = StableDiffusionPipeline.from_pretrained(folder)
    StableDiffusionPipeline(**{**pipe.components, "safety_checker": checker,
                               "feature_extractor": CLIPImageProcessor(size={"shortest_edge": 32},
                                                                       crop_size={"height": 32, "width": 32})},
                            requires_safety_checker=True).save_pretrained(out)
    return out


def test_safety_checker_in_the_folder_runs_as_in_diffusers(tiny_sd15_dir, tmp_path, caplog):
    folder = _with_safety_checker(tiny_sd15_dir, tmp_path / "checked", flag_everything=True)
    assert json.loads((folder / "model_index.json").read_text())["safety_checker"][0] == "stable_diffusion"
    params = _p(3, steps=2, num_images_per_prompt=2, height=64, width=64)
    with caplog.at_level(logging.WARNING):
        out = _run(DiffusionEngine(EngineConfig(model=str(folder))), "a cat", params)
    ref = _diffusers(folder, "a cat", params)
    assert np.abs(out.images - ref).max() <= PARITY
    assert out.images.max() == 0.0  # flagged images come back black, as in diffusers
    assert "safety checker blacked out image(s) [0, 1]" in caplog.text
    shutil.rmtree(folder)
    passing = _with_safety_checker(tiny_sd15_dir, tmp_path / "passing", flag_everything=False)
    out = _run(DiffusionEngine(EngineConfig(model=str(passing))), "a cat", params)
    assert out.images.max() > 0 and np.abs(out.images - _diffusers(passing, "a cat", params)).max() <= PARITY


# ----------------------------------------------------------------------- acceleration
# ------------------------------------------------------------------------- API and CLI
def test_spec_defaults(engines):
    spec = engines().spec
    assert (spec.default_height, spec.default_width, spec.resolution_factor) == (64, 64, 8)
    assert (spec.default_num_inference_steps, spec.default_guidance_scale) == (50, 7.5)


def test_cli_generate(tiny_sd15_dir, tmp_path, capsys):
    rc = main(["generate", "--model", str(tiny_sd15_dir), "--prompt", "a cat", "--negative-prompt", "blurry",
               "--steps", "2", "--guidance", "6", "--size", "48x32", "--seed", "4", "-o", str(tmp_path)])
    assert rc == 0, capsys.readouterr().err
    [path] = capsys.readouterr().out.split()
    from PIL import Image

    assert Image.open(path).size == (48, 32)
    rc = main(["generate", "--model", str(tiny_sd15_dir), "--prompt", "a cat", "--size", "36x64",
               "-o", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "width" in err[0] and "multiple of 8" in err[0]
