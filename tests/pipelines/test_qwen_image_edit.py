"""Qwen-Image-Edit (`QwenImageEditPipeline`) quirks: diffusers' input-size rule, the empty
negative prompt equal to diffusers, other aspect ratios and sizes in one forward (per-row RoPE
over each row's ``img_shapes``, padded and masked reference tokens), the prompt cache
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
import torch
from diffusers import QwenImageEditPipeline
from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit
from PIL import Image
from tiny_models.registry import QWEN_EDIT_TEST_AREA, qwen_edit_small_area

from diffserve import DiffusionEngine, EngineConfig, InvalidRequestError, SamplingParams
from diffserve.entrypoints.cli import main
from diffserve.pipelines.qwen_image_edit import adapter as qwen_image_edit
from diffserve.pipelines.qwen_image_edit.adapter import input_size, load_qwen2vl_processor, output_size
from seeds import image_generators

TOL = 1e-4
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


def test_other_aspect_ratios_and_sizes_share_a_forward(engine):
    """Inputs of three aspect ratios (references of 192x96, 96x192 and 128x128 pixels: different
    token counts and grids) beside outputs of three sizes, one with true CFG, run in ONE forward:
    each row gets diffusers' RoPE over its own two ``img_shapes`` (and its own text offset),
    both image segments padded and masked; each equals its solo run."""
    images = [_image(20, width=64, height=32), _image(21, width=32, height=64), _image(22, width=48, height=48)]
    assert len({input_size(i) for i in images}) == 3
    jobs = [("a", _p(1, true_cfg_scale=2.0, negative_prompt="x")),
            ("make the sky a deep orange", _p(2, steps=3, height=32, width=64, true_cfg_scale=3.0, negative_prompt="")),
            ("b", _p(3, height=64, width=64, true_cfg_scale=4.0, negative_prompt="blurry"))]
    outs = engine.generate([j[0] for j in jobs], [j[1] for j in jobs], inputs=images)
    assert [max(o.metrics.batch_sizes) for o in outs] == [6, 6, 6]
    for out, job, image in zip(outs, jobs, images):
        assert out.images.shape[1:3] == (job[1].height, job[1].width)
        assert np.abs(out.images - _solo(engine, *job, image).images).max() <= TOL


def test_no_mixed_sizes_runs_other_aspect_ratios_apart(tiny_qwen_image_edit_dir):
    engine = DiffusionEngine(EngineConfig(model=str(tiny_qwen_image_edit_dir), mixed_sizes=False))
    wide, tall = _image(20, width=64, height=32), _image(21, width=32, height=64)
    outs = engine.generate(["a", "b"], [_p(1), _p(2)], inputs=[wide, tall])
    assert [o.metrics.batch_sizes for o in outs] == [{1: 2}, {1: 2}]


def test_row_tables_follow_each_rows_img_shapes(tiny_qwen_image_edit_dir):
    """`RowRotary.tables` of rows with other target and reference grids: each row's image table
    is `QwenEmbedRope` over its own ``img_shapes`` (target tokens first, reference tokens from
    L_max on, 1 on padding), its text table starts after its own larger grid; `image_key_mask`
    marks the real keys of both segments."""
    from diffusers import QwenImageTransformer2DModel

    from diffserve.pipelines.qwen_image.mixed_sizes import PATCH, QwenSpans, RowRotary
    from diffserve.pipelines.row_data import RowData, forward_rows
    from diffserve.pipelines.token_spans import (IMAGE_TOKENS, LATENT_SIZE, REFERENCE_SIZE, REFERENCE_TOKENS,
                                                 image_key_mask)

    embed = QwenImageTransformer2DModel.from_pretrained(tiny_qwen_image_edit_dir / "transformer").pos_embed
    shapes = [[(1, 2, 3), (1, 4, 2)], [(1, 3, 2), (1, 10, 1)]]  # (frames, h, w) in tokens
    rows = RowData({LATENT_SIZE: tuple((PATCH * s[0][1], PATCH * s[0][2]) for s in shapes),
                    IMAGE_TOKENS: (6, 6),
                    REFERENCE_SIZE: tuple((PATCH * s[1][1], PATCH * s[1][2]) for s in shapes),
                    REFERENCE_TOKENS: (8, 10)}, 2)
    spans, cpu = QwenSpans(longest=6, reference=10), torch.device("cpu")
    with forward_rows(rows):
        image, text = RowRotary(embed).tables(5, spans, cpu)
        mask = image_key_mask(spans.longest, spans.reference, cpu)
    assert image.shape[:2] == (2, 16) and text.shape[:2] == (2, 5)
    for r, row_shapes in enumerate(shapes):
        freqs, txt = embed([row_shapes], device=cpu, max_txt_seq_len=5)
        torch.testing.assert_close(image[r, :6], freqs[:6])
        reference = rows[REFERENCE_TOKENS][r]
        torch.testing.assert_close(image[r, 6:6 + reference], freqs[6:])
        assert (image[r, 6 + reference:] == 1).all()
        torch.testing.assert_close(text[r], txt)
    assert not torch.equal(text[0], text[1])  # text starts after max(h/2, w/2) of the larger grid: 2 vs 5
    assert mask.tolist() == [[True] * 14 + [False] * 2, [True] * 16]


def test_mixed_references_under_teacache_equal_solo(tiny_qwen_image_edit_dir):
    """TeaCache on edits whose references differ in size: the request that computes its blocks
    alone (`narrowed_rows`) keeps its own tables and masks of both image segments, and each
    equals its run alone."""
    engine = DiffusionEngine(EngineConfig(model=str(tiny_qwen_image_edit_dir), cache_backend="teacache",
                                          cache_config={"rel_l1_thresh": 100.0}, overlap_stages=False))
    # the longer request has the larger output and reference: its layout (and cache) stays when the other leaves
    jobs = [("make it blue", _p(1, steps=4, height=32, width=48), _image(40, width=48, height=48)),
            ("add a hat", _p(2, steps=8), _image(41, width=64, height=32))]
    together = engine.generate([j[0] for j in jobs], [j[1] for j in jobs], inputs=[j[2] for j in jobs])
    assert max(together[0].metrics.batch_sizes) == 2
    assert engine.stats()["acceleration"]["cache_backend"]["skipped"] > 0
    for out, job in zip(together, jobs):
        assert np.abs(out.images - _solo(engine, *job).images).max() <= TOL


def test_regional_compile_without_recompiles_across_reference_sizes(tiny_qwen_image_edit_dir, tmp_path,
                                                                  fresh_dynamo):
    """Compiled blocks warmed up at the default size serve forwards whose references (and
    outputs) and texts (vision tokens included) differ in size, in different compositions,
    without recompiling (the warm-up also runs a text-padded pair, as in text-to-image)."""
    import json
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(tiny_qwen_image_edit_dir, folder)
    (folder / "generation_config.json").write_text(json.dumps({"height": 64, "width": 64}))  # warm-up size
    engine = DiffusionEngine(EngineConfig(model=str(folder), compile=True, max_batch_size=2))
    eager = DiffusionEngine(EngineConfig(model=str(folder)))
    jobs = [("a", _p(1, height=64, width=64), _image(50, width=48, height=48)),  # reference 128x128
            ("a cat", _p(2, height=64, width=64), _image(51, width=64, height=32)),  # 192x96: more tokens
            ("a red fox in the snow", _p(3, height=32, width=64), _image(52, width=32, height=64))]  # 96x192
    for pair in (jobs[:2], jobs[1:]):
        outs = engine.generate([j[0] for j in pair], [j[1] for j in pair], inputs=[j[2] for j in pair])
        assert [max(o.metrics.batch_sizes) for o in outs] == [2, 2]
        for out, job in zip(outs, pair):
            assert np.abs(out.images - _solo(eager, *job).images).max() <= TOL
    stats = engine.runner.acceleration_stats()["compile"]
    assert stats["enabled"] and stats["recompiles_after_warmup"] == 0


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

