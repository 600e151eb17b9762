"""The training code of the built-in models lives outside the package (``training/`` at the
repository root, not in the wheel) and still runs: each entry point answers ``--help`` from the
repository root, and one tiny training step of each model saves a folder its diffusers pipeline
class loads. (The digits model's tiny run that also generates: tests/models/test_digits.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import training
from training.digits_video import train as video_train

REPO = Path(__file__).resolve().parents[2]


def test_training_is_the_top_level_folder_outside_the_package():
    assert Path(training.__file__).resolve().parent == REPO / "training"
    import diffserve

    assert not (Path(diffserve.__file__).resolve().parent / "models" / "training.py").exists()


@pytest.mark.parametrize("module", ["training.digits.train", "training.digits_video.train",
                                    "training.digits_mirror.train", "training.digits_reasoning.train"])
def test_entry_point_runs_from_the_repository_root(module):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", module, "--help"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage:")


def test_video_model_tiny_training_step_saves_a_wan_folder(tmp_path):
    out = video_train.main(["--tiny", "--vae-steps", "1", "--max-steps", "1", "--clips-per-digit", "1",
                            "--out", str(tmp_path / "model"), "--threads", "1"])
    index = json.loads((out / "model_index.json").read_text())
    assert index["_class_name"] == "WanPipeline"
    assert (out / "MODEL_CARD.md").is_file()
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(out)
    assert pipe.transformer is not None and pipe.vae is not None


def test_one_mirror_lora_step_saves_a_lora_diffserve_and_diffusers_load(tmp_path):
    """The built-in `mirror` LoRA's training: one tiny step writes diffusers' LoRA format."""
    from diffusers import StableDiffusion3Pipeline

    from diffserve.lora.reading import read_lora
    from diffserve.models.digits import DEFAULT_MODEL_PATH
    from training.digits_mirror import train as mirror_train

    out = mirror_train.main(["--out", str(tmp_path / "mirror"), "--max-steps", "1", "--batch-size", "8"])
    pipe = StableDiffusion3Pipeline.from_pretrained(DEFAULT_MODEL_PATH, text_encoder_3=None, tokenizer_3=None)
    adapter = read_lora(out, pipe, "m")
    assert adapter.rank == 8 and adapter.num_modules == 45
    pipe.load_lora_weights(str(out), adapter_name="m")


def test_reasoning_model_tiny_training_step_saves_a_two_stage_folder(tmp_path):
    from diffserve.pipelines.digits_reasoning.pipeline import DigitsReasoningPipeline
    from training.digits_reasoning import train as reasoning_train

    out = reasoning_train.main(["--tiny", "--out", str(tmp_path / "model"), "--threads", "1"])
    index = json.loads((out / "model_index.json").read_text())
    assert index["_class_name"] == "DigitsReasoningPipeline"
    assert index["language_model"] == ["transformers", "Qwen2ForCausalLM"]
    pipe = DigitsReasoningPipeline.from_pretrained(out)
    result = pipe("three plus four", num_inference_steps=1, output_type="np")
    assert result.images.shape == (1, 8, 8, 1) and isinstance(result.ar_texts[0], str)
