"""Loading diffusers folders: registry, dummy load format, clear errors."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from diffserve import DiffusionEngine, EngineConfig, SamplingParams, UnsupportedModelError
from diffserve.pipelines.registry import supported_pipelines
from diffserve.runner.loader import load_components


def test_loads_every_component_from_its_subfolder(tiny_sd3_dir):
    class_name, components = load_components(tiny_sd3_dir, torch.float32)
    assert class_name == "StableDiffusion3Pipeline"
    assert type(components["transformer"]).__name__ == "SD3Transformer2DModel"
    assert type(components["text_encoder_2"]).__name__ == "CLIPTextModelWithProjection"
    assert components["text_encoder_3"] is None


def test_dummy_format_reads_no_weights(tiny_sd3_dir, tmp_path):
    folder = tmp_path / "no_weights"
    shutil.copytree(tiny_sd3_dir, folder)
    removed = [p for p in folder.rglob("*.safetensors")]
    for p in removed:
        p.unlink()
    assert removed
    with pytest.raises(Exception):
        DiffusionEngine(EngineConfig(model=str(folder)))  # default format needs the weights
    a = DiffusionEngine(EngineConfig(model=str(folder), load_format="dummy"))
    b = DiffusionEngine(EngineConfig(model=str(folder), load_format="dummy"))
    params = SamplingParams(num_inference_steps=2, seed=0, output_type="np")
    [out_a], [out_b] = a.generate("x", params), b.generate("x", params)
    assert out_a.ok and out_a.images.shape == (1, 64, 64, 3)
    assert np.array_equal(out_a.images, out_b.images)  # seeded random weights


def test_unknown_pipeline_class_lists_supported(tiny_sd3_dir, tmp_path):
    folder = tmp_path / "other"
    shutil.copytree(tiny_sd3_dir, folder)
    index = json.loads((folder / "model_index.json").read_text())
    index["_class_name"] = "MysteryPipeline"
    (folder / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(UnsupportedModelError) as info:
        DiffusionEngine(EngineConfig(model=str(folder)))
    assert "MysteryPipeline" in str(info.value)
    for name in supported_pipelines():
        assert name in str(info.value)


def test_not_a_diffusers_folder(tmp_path):
    with pytest.raises(UnsupportedModelError, match="model_index.json"):
        DiffusionEngine(EngineConfig(model=str(tmp_path)))
