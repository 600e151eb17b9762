"""diffserve on the shipped default model: defaults and the main-job CLI (parity with diffusers:
tests/conformance/, the ``StableDiffusion3Pipeline-digits`` entry)."""

from __future__ import annotations

import pytest
from PIL import Image

from diffserve import DiffusionEngine, EngineConfig
from diffserve.entrypoints.cli import main
from diffserve.models.digits import DEFAULT_MODEL_PATH


@pytest.fixture(scope="module")
def default_engine():
    return DiffusionEngine(EngineConfig())  # model=None -> the built-in digits model


def test_default_model_and_its_sampling_defaults(default_engine):
    assert default_engine.config.model_path == DEFAULT_MODEL_PATH
    spec = default_engine.spec
    assert (spec.default_height, spec.default_width, spec.resolution_factor) == (8, 8, 2)
    assert (spec.default_num_inference_steps, spec.default_guidance_scale) == (20, 4.0)


def test_main_job_cli_writes_a_viewable_png(tmp_path, capsys):
    rc = main(["generate", "--prompt", "a handwritten digit 7", "--seed", "0", "--display-size", "64",
               "-o", str(tmp_path)])
    assert rc == 0
    [path] = capsys.readouterr().out.split()
    assert Image.open(path).size == (64, 64)
    raw = sorted(tmp_path.glob("*_raw.png"))
    assert len(raw) == 1 and Image.open(raw[0]).size == (8, 8)


def test_out_of_vocabulary_prompt_warns(tmp_path, capsys):
    rc = main(["generate", "--prompt", "a zebra digit 7", "--steps", "2", "-o", str(tmp_path)])
    assert rc == 0
    assert "zebra" in capsys.readouterr().err
