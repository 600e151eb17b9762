"""Qwen-Image-Edit (`QwenImageEditPipeline`) quirks: diffusers' input-size rule, the empty
negative prompt equal to diffusers, other aspect ratios in their own forwards, the prompt cache
keyed on the image, refusals of several images, CLI. (Parity, co-batched edits of different input
images, refusals of unused fields, cache backends: tests/conformance/.)

diffusers resizes every input image to ~1 megapixel (``calculate_dimensions(1024 * 1024, ratio)``
in ``__call__``); the tiny Qwen VAE takes ~9 s to encode that on one CPU thread. So these tests
set that area to 128x128 pixels on BOTH sides (`tiny_models.registry.qwen_edit_small_area`, as
the conformance suite does): the same code runs, on smaller tensors.
`test_input_size_is_diffusers_rule` checks the real 1-megapixel rule itself.
"""

from __future__ import annotations

import numpy as np
import pytest
from diffusers import QwenImageEditPipeline
from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit
from PIL import Image
from tiny_models.registry import QWEN_EDIT_TEST_AREA, qwen_edit_small_area

from diffserve import DiffusionEngine, EngineConfig, InvalidRequestError, SamplingParams
from diffserve.entrypoints.cli import main
from diffserve.pipelines.qwen_image_edit import adapter as qwen_image_edit
from diffserve.pipelines.qwen_image_edit.adapter import input_size, load_qwen2vl_processor, output_size
from seeds import image_generators

REAL_CALCULATE_DIMENSIONS = pipeline_qwenimage_edit.calculate_dimensions


@pytest.fixture(scope="module", autouse=True)
def small_input_area():
    with qwen_edit_small_area():
        yield


@pytest.fixture(scope="module")
def engine(tiny_qwen_image_edit_dir):
    eng = DiffusionEngine(EngineConfig(model=str(tiny_qwen_image_edit_dir), max_batch_size=16))
    yield eng
    assert not eng.has_unfinished_requests()


@pytest.fixture(scope="module")
def pipe(tiny_qwen_image_edit_dir):
    folder = tiny_qwen_image_edit_dir
    p = QwenImageEditPipeline.from_pretrained(folder, processor=load_qwen2vl_processor(folder / "processor"))
    p.set_progress_bar_config(disable=True)
    return p


def _image(seed, width=56, height=40):
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def _p(seed, steps=2, **kw):
    return SamplingParams(seed=seed, num_inference_steps=steps, output_type="np", **{"height": 64, "width": 48, **kw})


def _reference(pipe, image, prompt, params: SamplingParams):
    return pipe(image=image, prompt=prompt, negative_prompt=params.negative_prompt,
                true_cfg_scale=params.true_cfg_scale or 4.0, num_images_per_prompt=params.num_images_per_prompt,
                num_inference_steps=params.num_inference_steps, height=params.height, width=params.width,
                generator=image_generators(params.seed, params.num_images_per_prompt), output_type="np").images


def _solo(engine, prompt, params, image):
    [out] = engine.generate(prompt, params, inputs=image)
    assert out.ok, out.error
    return out


def test_input_size_is_diffusers_rule():
    image = _image(0, width=300, height=200)
    assert qwen_image_edit.TARGET_AREA == QWEN_EDIT_TEST_AREA  # (patched; the module holds diffusers' constant)
    width, height, _ = REAL_CALCULATE_DIMENSIONS(1024 * 1024, 300 / 200)
    assert (width, height) == (1248, 832)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(qwen_image_edit, "TARGET_AREA", 1024 * 1024)
        assert input_size(image) == (832, 1248) and output_size(image) == (832, 1248)


@pytest.mark.parametrize("params,rows", [
    (_p(3, steps=3, negative_prompt="", true_cfg_scale=2.0, num_images_per_prompt=2), 4),
], ids=["true-cfg-empty-negative-n2"])
def test_matches_diffusers(engine, pipe, params, rows):
    image = _image(1)
    out = _solo(engine, "make it blue", params, image)
    ref = _reference(pipe, image, "make it blue", params)
    assert out.images.shape == ref.shape == (params.num_images_per_prompt, 64, 48, 3)
    assert np.abs(out.images - ref).max() <= 1 / 255
    assert out.metrics.batch_sizes == {rows: params.num_inference_steps}


def test_other_aspect_ratio_runs_in_its_own_forwards(engine):
    wide, tall = _image(20, width=64, height=32), _image(21, width=32, height=64)
    assert input_size(wide) != input_size(tall)
    outs = engine.generate(["a", "b"], [_p(1), _p(2)], inputs=[wide, tall])
    assert [o.metrics.batch_sizes for o in outs] == [{1: 2}, {1: 2}]


def test_prompt_cache_keys_on_the_image(tiny_qwen_image_edit_dir):
    engine = DiffusionEngine(EngineConfig(model=str(tiny_qwen_image_edit_dir)))
    first, second = _image(30), _image(31)
    a = _solo(engine, "make it blue", _p(1), first).images
    b = _solo(engine, "make it blue", _p(1), second).images
    again = _solo(engine, "make it blue", _p(1), first.copy()).images
    stats = engine.runner.acceleration_stats()["prompt_embed_cache"]
    assert (stats["misses"], stats["hits"]) == (2, 1)
    assert np.abs(a - b).max() > 1e-3  # the other image's encoding was not reused
    np.testing.assert_array_equal(a, again)


def test_refusals(engine, tiny_qwen_image_edit_dir, tmp_path, capsys):
    image = _image(0)
    with pytest.raises(InvalidRequestError, match="image"):
        engine.generate("make it blue", _p(1), inputs=[[image, image]])
    # the CLI has no input image: a one-line error naming it
    code = main(["generate", "--model", str(tiny_qwen_image_edit_dir), "--prompt", "make it blue",
                 "--steps", "2", "--size", "48x64", "-o", str(tmp_path)])
    assert code == 2 and "image" in capsys.readouterr().err

