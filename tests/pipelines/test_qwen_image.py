"""Qwen-Image (`QwenImagePipeline`) quirks: the empty negative prompt and a cut text equal
diffusers, one step with Qwen-Image-Lightning's scheduler (and refused with shift_terminal), the
text budget's limit, regional compile with dynamic text length, CLI. (Parity, batching of
variable-length text with padding masks, refusals, cache backends: tests/conformance/.)"""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline

from diffserve import DiffusionEngine, EngineConfig, InvalidRequestError, SamplingParams
from diffserve.entrypoints.cli import main
from seeds import image_generators

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
                generator=image_generators(params.seed, params.num_images_per_prompt), output_type="np", **kwargs).images


def _solo(engine, prompt, params):
    [out] = engine.generate(prompt, params)
    assert out.ok, out.error
    return out


@pytest.mark.parametrize("params,rows", [
    (_p(3, steps=2, negative_prompt="", true_cfg_scale=2.5, num_images_per_prompt=2), 4),
    (_p(4, negative_prompt="ugly", max_sequence_length=4), 2),       # both texts cut to 4 tokens
], ids=["true-cfg-empty-negative-n2", "max-sequence-length"])
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


def test_text_budget_beyond_diffusers_limit_is_refused(engine):
    with pytest.raises(InvalidRequestError, match="max_sequence_length"):
        engine.generate("a cat", _p(1, max_sequence_length=2048))


# ---------------------------------------------------------------------------- acceleration
def test_sizes_mix_with_their_own_image_and_text_positions(engine):
    """32x64 and 64x32 pack to the same token count (no padding) but differ in their image RoPE
    and in where their text positions start (after max(h, w) / 2 of the grid); 64x64 pads both.
    In one forward each equals its solo run; texts of different lengths are padded too."""
    jobs = [("a red kite", _p(1, height=32, width=64)), ("a blue boat on a quiet lake", _p(2, height=64, width=32)),
            ("snow", _p(3, steps=2, height=64, width=64))]
    outs = engine.generate([j[0] for j in jobs], [j[1] for j in jobs])
    assert [max(o.metrics.batch_sizes) for o in outs] == [3, 3, 3]
    for out, job in zip(outs, jobs):
        assert out.images.shape[1:3] == (job[1].height, job[1].width)
        [solo] = engine.generate(*job)
        assert np.abs(out.images - solo.images).max() <= TOL


def test_mixed_sizes_under_teacache_equal_solo(tiny_qwen_image_dir):
    """TeaCache on mixed Qwen-Image rows: the request that computes its blocks alone keeps its
    own positions and masks (`narrowed_rows`), and each equals its run alone."""
    engine = DiffusionEngine(EngineConfig(model=str(tiny_qwen_image_dir), cache_backend="teacache",
                                          cache_config={"rel_l1_thresh": 100.0}, overlap_stages=False))
    small, large = _p(1, steps=4, height=32, width=48), _p(2, steps=8, height=64, width=48)
    together = engine.generate(["a cat", "a dog in the rain"], [small, large])
    assert max(together[0].metrics.batch_sizes) == 2
    assert engine.stats()["acceleration"]["cache_backend"]["skipped"] > 0
    for out, job in zip(together, (("a cat", small), ("a dog in the rain", large))):
        [solo] = engine.generate(*job)
        assert np.abs(out.images - solo.images).max() <= TOL


def test_regional_compile_without_recompiles_after_warm_up(tiny_qwen_image_dir, tmp_path):
    """Text lengths other than the warm-up prompt's reuse the warmed-up graphs (text length is a
    dynamic dimension), alone and batched beside a prompt of another length (text padding: the
    warm-up ran a padded pair too, so the mask input being a tensor compiles nothing new)."""
    folder = tmp_path / "model"
    shutil.copytree(tiny_qwen_image_dir, folder)
    (folder / "generation_config.json").write_text(json.dumps({"height": 64, "width": 64}))  # warm-up size
    engine = DiffusionEngine(EngineConfig(model=str(folder), compile=True, max_batch_size=2))
    eager = DiffusionEngine(EngineConfig(model=str(folder)))
    prompts = ["cat", "a much longer prompt than the warm-up one"]
    params = [_p(1, height=64, width=64), _p(2, height=64, width=64)]
    together = engine.generate(prompts, params)
    assert [max(o.metrics.batch_sizes) for o in together] == [2, 2]  # one text-padded forward
    for out, prompt, p in zip(together, prompts, params):
        assert np.abs(out.images - _solo(eager, prompt, p).images).max() <= TOL
        assert np.abs(_solo(engine, prompt, p).images - _solo(eager, prompt, p).images).max() <= TOL
    stats = engine.runner.acceleration_stats()["compile"]
    assert stats["enabled"] and stats["recompiles_after_warmup"] == 0, stats


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
