"""Qwen-Image (`QwenImagePipeline`): parity with diffusers, batching of variable-length text
with padding masks, true CFG with norm rescale, acceleration backends, CLI and refusals."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline

from diffserve import DiffusionEngine, EngineConfig, InvalidRequestError, SamplingParams
from diffserve.entrypoints.cli import main

TOL = 1e-4
SIZE = dict(height=64, width=48)

#: Qwen-Image-Lightning's scheduler (github.com/ModelTC/Qwen-Image-Lightning, generate_with_diffusers.py):
#: shift 3, no shift_terminal, so 1-step schedules are valid.
LIGHTNING_SCHEDULER = dict(base_image_seq_len=256, base_shift=math.log(3), max_image_seq_len=8192,
                           max_shift=math.log(3), num_train_timesteps=1000, shift=1.0, shift_terminal=None,
                           time_shift_type="exponential", use_dynamic_shifting=True)


@pytest.fixture(scope="module")
def engine(tiny_qwen_image_dir):
    eng = DiffusionEngine(EngineConfig(model=str(tiny_qwen_image_dir), max_batch_size=16))
    yield eng
    assert not eng.has_unfinished_requests()


@pytest.fixture(scope="module")
def lightning_dir(tiny_qwen_image_dir, tmp_path_factory):
    """The tiny folder with Qwen-Image-Lightning's scheduler config."""
    folder = tmp_path_factory.mktemp("tiny_qwen_lightning") / "model"
    shutil.copytree(tiny_qwen_image_dir, folder)
    FlowMatchEulerDiscreteScheduler(**LIGHTNING_SCHEDULER).save_pretrained(folder / "scheduler")
    return folder


def _p(seed, steps=3, **kw):
    return SamplingParams(seed=seed, num_inference_steps=steps, output_type="np", **{**SIZE, **kw})


def _reference(folder, prompt, params: SamplingParams):
    pipe = QwenImagePipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    kwargs = {"max_sequence_length": params.max_sequence_length} if params.max_sequence_length else {}
    if params.true_cfg_scale is not None:
        kwargs["true_cfg_scale"] = params.true_cfg_scale
    return pipe(prompt, negative_prompt=params.negative_prompt, num_images_per_prompt=params.num_images_per_prompt,
                num_inference_steps=params.num_inference_steps, height=params.height, width=params.width,
                generator=torch.Generator("cpu").manual_seed(params.seed), output_type="np", **kwargs).images


def _solo(engine, prompt, params):
    [out] = engine.generate(prompt, params)
    assert out.ok, out.error
    return out


@pytest.mark.parametrize("params,rows", [
    (_p(1), 1),                                                        # default true_cfg_scale, no negative: no CFG
    (_p(2, negative_prompt="blurry, low quality", true_cfg_scale=4.0), 2),
    (_p(3, steps=2, negative_prompt="", true_cfg_scale=2.5, num_images_per_prompt=2), 4),
    (_p(4, negative_prompt="ugly", max_sequence_length=4), 2),       # both texts cut to 4 tokens
], ids=["no-cfg", "true-cfg", "true-cfg-empty-negative-n2", "max-sequence-length"])
def test_matches_diffusers(engine, tiny_qwen_image_dir, params, rows):
    prompt = "a red apple on a wooden table"
    out = _solo(engine, prompt, params)
    ref = _reference(tiny_qwen_image_dir, prompt, params)
    assert out.images.shape == ref.shape == (params.num_images_per_prompt, 64, 48, 3)
    assert np.abs(out.images - ref).max() <= 1 / 255
    assert out.metrics.batch_sizes == {rows: params.num_inference_steps}
    assert out.prompt_truncated is (params.max_sequence_length == 4)


def test_one_step_matches_diffusers_with_a_lightning_scheduler(lightning_dir):
    engine = DiffusionEngine(EngineConfig(model=str(lightning_dir)))
    for params in (_p(5, steps=1), _p(6, steps=1, negative_prompt="dark", true_cfg_scale=3.0)):
        out = _solo(engine, "a lighthouse", params)
        assert np.abs(out.images - _reference(lightning_dir, "a lighthouse", params)).max() <= 1 / 255


def test_one_step_is_refused_with_shift_terminal(engine):
    # diffusers stretches a 1-sigma schedule to shift_terminal as 0/0: NaN images
    with pytest.raises(InvalidRequestError, match="num_inference_steps"):
        engine.generate("a cat", _p(1, steps=1))


def test_padded_batch_equals_solo_runs(engine):
    """Three texts of different lengths, seeds, step counts and guidance in one forward: the
    padded, masked rows equal their unpadded solo runs."""
    pipe_tokenizer = engine.runner.adapter.pipe.tokenizer
    jobs = [("a lighthouse at dusk", _p(5, steps=4, negative_prompt="blurry", true_cfg_scale=4.0)),
            ("a bowl of fruit on a marble kitchen counter, soft morning light", _p(9, steps=2, negative_prompt="",
                                                                                    true_cfg_scale=2.0)),
            ("snow", _p(13, steps=3, negative_prompt="a long negative prompt about many defects", true_cfg_scale=6.0))]
    assert len({len(pipe_tokenizer(p).input_ids) for p, _ in jobs}) == 3  # really different lengths
    outs = engine.generate([p for p, _ in jobs], [q for _, q in jobs])
    for (prompt, params), out in zip(jobs, outs):
        assert out.ok, out.error
        assert np.abs(out.images - _solo(engine, prompt, params).images).max() <= TOL
    assert max(outs[0].metrics.batch_sizes) == 6  # 3 requests x 2 true-CFG rows shared forwards


def test_unused_and_bad_fields_are_refused(engine):
    with pytest.raises(InvalidRequestError, match="guidance_scale"):
        engine.generate("a cat", _p(1, guidance_scale=3.0))
    with pytest.raises(InvalidRequestError, match="max_sequence_length"):
        engine.generate("a cat", _p(1, max_sequence_length=2048))
    with pytest.raises(InvalidRequestError, match="image"):
        engine.generate("a cat", _p(1), inputs=np.zeros((16, 16, 3), dtype=np.uint8))


# ---------------------------------------------------------------------------- acceleration
@pytest.mark.parametrize("backend,options,skips", [
    ("teacache", {"rel_l1_thresh": 0.0}, False),
    ("teacache", {"rel_l1_thresh": 0.5}, True),
    ("cache_dit", {"Fn_compute_blocks": 1, "residual_diff_threshold": 0.0}, False),
    ("cache_dit", {"Fn_compute_blocks": 1, "residual_diff_threshold": 0.5, "max_warmup_steps": 2}, True),
])
def test_cache_backends(engine, tiny_qwen_image_dir, backend, options, skips):
    cached = DiffusionEngine(EngineConfig(model=str(tiny_qwen_image_dir), cache_backend=backend,
                                          cache_config=options))
    jobs = [("a boat on the sea", _p(5, steps=8, negative_prompt="ugly", true_cfg_scale=3.0)),
            ("a small red kite in the wind", _p(6, steps=6, negative_prompt="", true_cfg_scale=5.0))]
    outs = cached.generate([p for p, _ in jobs], [q for _, q in jobs])
    stats = cached.runner.acceleration_stats()["cache_backend"]
    assert (stats["skipped"] > 0) is skips
    for (prompt, params), out in zip(jobs, outs):
        if not skips:  # nothing cached: the uncached engine's result (batched vs solo: float
            # noise, 1.0e-5 measured on an AMD EPYC with 1 thread, below 5e-6 on others)
            assert np.abs(out.images - _solo(engine, prompt, params).images).max() <= TOL
        # per-request caching: a batched request equals its solo run with the same backend
        assert np.abs(out.images - _solo(cached, prompt, params).images).max() <= TOL
    if backend == "teacache":
        assert max(outs[0].metrics.batch_sizes) == 4  # teacache keeps the forwards shared


def test_regional_compile_without_recompiles_after_warm_up(tiny_qwen_image_dir, tmp_path):
    """One row per forward (one graph to compile): the warm-up prompt's text length and another
    length reuse the warmed-up graph (text length is a dynamic dimension)."""
    folder = tmp_path / "model"
    shutil.copytree(tiny_qwen_image_dir, folder)
    (folder / "generation_config.json").write_text(json.dumps({"height": 64, "width": 64}))  # warm-up size
    engine = DiffusionEngine(EngineConfig(model=str(folder), compile=True, max_batch_size=1))
    eager = DiffusionEngine(EngineConfig(model=str(folder)))
    for prompt in ("warm-up", "a much longer prompt than the warm-up one"):
        params = _p(1, height=64, width=64)
        assert np.abs(_solo(engine, prompt, params).images - _solo(eager, prompt, params).images).max() <= TOL
    stats = engine.runner.acceleration_stats()["compile"]
    assert stats["enabled"] and stats["recompiles_after_warmup"] == 0


# ------------------------------------------------------------------------------------ CLI
def test_cli_generate(tiny_qwen_image_dir, tmp_path, capsys):
    code = main(["generate", "--model", str(tiny_qwen_image_dir), "--prompt", "a red fox", "--negative-prompt", "",
                 "--steps", "2", "--size", "48x64", "--seed", "1", "-o", str(tmp_path)])
    assert code == 0, capsys.readouterr().err
    [png] = tmp_path.glob("*.png")
    from PIL import Image

    assert Image.open(png).size == (48, 64)


def test_cli_names_an_unused_field(tiny_qwen_image_dir, tmp_path, capsys):
    code = main(["generate", "--model", str(tiny_qwen_image_dir), "--prompt", "a red fox", "--guidance", "3",
                 "--steps", "2", "--size", "48x64", "-o", str(tmp_path)])
    assert code == 2
    assert "argument --guidance: invalid value 3.0" in capsys.readouterr().err
