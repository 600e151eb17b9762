"""FluxPipeline (schnell and dev layouts): parity with diffusers, step batching with embedded
guidance and true CFG, acceleration backends, CLI and field refusals."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from diffusers import FluxPipeline

from diffserve import DiffusionEngine, EngineConfig, InvalidRequestError, SamplingParams
from diffserve.entrypoints.cli import main

TOL = 1e-4
SIZE = dict(height=64, width=48)
L = 32  # max_sequence_length: short T5 text keeps the tiny forwards cheap


@pytest.fixture(scope="module")
def schnell(tiny_flux_dir):
    return DiffusionEngine(EngineConfig(model=str(tiny_flux_dir)))


@pytest.fixture(scope="module")
def dev(tiny_flux_dev_dir):
    return DiffusionEngine(EngineConfig(model=str(tiny_flux_dev_dir)))


@pytest.fixture(scope="module")
def flux_dev_blocks(tmp_path_factory):
    """A dev-layout folder with 3 double + 3 single blocks (block caches need blocks to skip)."""
    from tiny_models import build_tiny_flux

    folder = build_tiny_flux(tmp_path_factory.mktemp("tiny_flux_dev3"), variant="dev", num_layers=3,
                             num_single_layers=3)
    return folder


def _p(seed, steps=3, **kw):
    return SamplingParams(seed=seed, num_inference_steps=steps, **{"output_type": "np", "max_sequence_length": L,
                                                                    **SIZE, **kw})


def _run(engine, prompt, params):
    [out] = engine.generate(prompt, params)
    assert out.ok, out.error
    return out


# ------------------------------------------------------------------------------ parity
CASES = {  # id: (steps, guidance_scale, true_cfg_scale, negative_prompt, images, forward rows)
    "plain": (4, 3.5, None, None, 1, 1),
    "one-step": (1, 3.5, None, None, 1, 1),
    "true-cfg": (3, 2.0, 4.0, "blurry", 1, 2),
    "true-cfg-empty-negative-n2": (2, 5.0, 3.0, "", 2, 4),
    "true-cfg-one-step": (1, 3.5, 2.0, "dark", 1, 2),
    # diffusers' rule: true CFG needs true_cfg_scale > 1 AND a negative prompt
    "scale-without-negative": (2, 3.5, 4.0, None, 1, 1),
    "negative-without-scale": (2, 3.5, 1.0, "dark", 1, 1),
}


@pytest.mark.parametrize("variant", ["schnell", "dev"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_diffusers(variant, case, request):
    folder = request.getfixturevalue("tiny_flux_dir" if variant == "schnell" else "tiny_flux_dev_dir")
    engine = request.getfixturevalue(variant)
    steps, guidance, true_cfg, negative, n, rows = CASES[case]
    kw = dict(num_inference_steps=steps, num_images_per_prompt=n, negative_prompt=negative, max_sequence_length=L,
              **SIZE)
    if true_cfg is not None:
        kw["true_cfg_scale"] = true_cfg
    if variant == "dev":
        kw["guidance_scale"] = guidance
    pipe = FluxPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    ref = pipe("a photo of a cat", generator=torch.Generator("cpu").manual_seed(7), output_type="np", **kw).images
    out = _run(engine, "a photo of a cat", SamplingParams(seed=7, output_type="np", **kw))
    assert out.images.shape == ref.shape == (n, 64, 48, 3)
    assert np.abs(out.images - ref).max() <= 1e-5  # measured: 0 without true CFG, ~1e-6 with
    assert out.metrics.batch_sizes == {rows: steps}  # one forward per step; true CFG doubles rows


def test_latent_output_is_packed_like_diffusers(dev):
    out = _run(dev, "a cat", _p(3, steps=1, output_type="latent"))
    assert out.images.shape == (1, (64 // 16) * (48 // 16), 64)


# -------------------------------------------------------------------- step batching
@pytest.mark.parametrize("true_cfg", [False, True], ids=["embedded-guidance", "true-cfg"])
def test_batch_invariance(dev, true_cfg):
    """Different prompts, seeds, step counts and embedded guidance (a per-row input) in one
    forward; with true CFG also different true_cfg_scale (per-row weights)."""
    extra = [dict(true_cfg_scale=s, negative_prompt=neg) for s, neg in ((2.0, "dark"), (4.0, ""), (3.0, "ugly"))] \
        if true_cfg else [{}, {}, {}]
    jobs = [("a red house", _p(5, steps=4, guidance_scale=3.5, **extra[0])),
            ("a bowl of fruit", _p(9, steps=2, guidance_scale=1.5, **extra[1])),
            ("snowy mountains", _p(13, steps=5, guidance_scale=6.0, **extra[2]))]
    outs = dev.generate([j[0] for j in jobs], [j[1] for j in jobs])
    for out, job in zip(outs, jobs):
        assert out.ok, out.error
        assert np.abs(out.images - _run(dev, *job).images).max() <= TOL
    assert max(outs[0].metrics.batch_sizes) == 3 * (2 if true_cfg else 1)  # really shared forwards


def test_sequence_length_and_size_decide_the_batch(dev):
    outs = dev.generate(["a", "b", "c"], [_p(1), _p(2, max_sequence_length=16), _p(3, height=32, width=32)])
    assert [max(o.metrics.batch_sizes) for o in outs] == [1, 1, 1]
    assert outs[2].images.shape == (1, 32, 32, 3)


# ---------------------------------------------------------------- spec and refusals
def test_defaults_follow_diffusers_and_generation_config(schnell, dev, tiny_flux_dev_dir, tmp_path):
    spec = dev.spec
    assert (spec.default_num_inference_steps, spec.default_guidance_scale, spec.default_true_cfg_scale,
            spec.default_max_sequence_length, spec.default_height, spec.default_width,
            spec.resolution_factor) == (28, 3.5, 1.0, 512, 1024, 1024, 16)
    assert schnell.spec.default_guidance_scale is None  # no guidance embedding
    folder = shutil.copytree(tiny_flux_dev_dir, tmp_path / "flux")
    (folder / "generation_config.json").write_text(json.dumps(
        {"num_inference_steps": 4, "guidance_scale": 2.0, "height": 32, "width": 48, "max_sequence_length": 64}))
    spec = DiffusionEngine(EngineConfig(model=str(folder))).spec
    assert (spec.default_num_inference_steps, spec.default_guidance_scale, spec.default_height, spec.default_width,
            spec.default_max_sequence_length) == (4, 2.0, 32, 48, 64)


@pytest.mark.parametrize("fields,field", [
    ({"guidance_scale": 2.0}, "guidance_scale"),   # schnell has no guidance embedding
    ({"max_sequence_length": 513}, "max_sequence_length"),
    ({"num_frames": 5}, "num_frames"),
    ({"strength": 0.5}, "strength"),
    ({"height": 40}, "height"),                    # not a multiple of 16
])
def test_unused_or_bad_fields_are_refused_by_name(schnell, fields, field):
    with pytest.raises(InvalidRequestError) as info:
        schnell.generate("a cat", SamplingParams(**fields))
    assert info.value.field == field


def test_input_images_are_refused(schnell):
    from PIL import Image

    with pytest.raises(InvalidRequestError) as info:
        schnell.generate("a cat", _p(1), inputs=Image.new("RGB", (64, 64)))
    assert info.value.field == "image"


# ------------------------------------------------------------------------ acceleration
def _engine(folder, backend="none", options=None, **kw):
    return DiffusionEngine(EngineConfig(model=str(folder), cache_backend=backend, cache_config=options or {}, **kw))


def test_teacache_mixed_batch_equals_solo_runs(flux_dev_blocks):
    options = {"rel_l1_thresh": 0.3}
    engine = _engine(flux_dev_blocks, "teacache", options)
    jobs = [("one", _p(11, steps=10)), ("two", _p(12, steps=7, guidance_scale=2.0)),
            ("three", _p(13, steps=9, guidance_scale=5.0))]
    outs = engine.generate([j[0] for j in jobs], [j[1] for j in jobs])
    stats = engine.runner.acceleration_stats()["cache_backend"]
    assert stats["skipped"] > 0 and "TeaCache4FLUX" in stats["coefficients_source"]
    assert max(outs[0].metrics.batch_sizes) == 3
    for out, job in zip(outs, jobs):
        assert np.abs(out.images - _run(_engine(flux_dev_blocks, "teacache", options), *job).images).max() <= TOL
    # threshold 0 never skips: the plain forward
    zero = _engine(flux_dev_blocks, "teacache", {"rel_l1_thresh": 0.0})
    assert np.abs(_run(zero, *jobs[0]).images - _run(_engine(flux_dev_blocks), *jobs[0]).images).max() <= 1e-5
    assert zero.runner.acceleration_stats()["cache_backend"]["skipped"] == 0


@pytest.mark.parametrize("taylorseer", [False, True])
def test_cache_dit_caches_both_block_lists_per_request(flux_dev_blocks, taylorseer):
    options = {"Fn_compute_blocks": 1, "residual_diff_threshold": 0.5, "max_warmup_steps": 2,
               "taylorseer": taylorseer}
    engine = _engine(flux_dev_blocks, "cache_dit", options)
    a, b = ("a red house", _p(3, steps=8)), ("a green tree", _p(4, steps=5, height=32, width=32, true_cfg_scale=3.0,
                                                                negative_prompt="x"))
    first = _run(engine, *a).images
    _run(engine, *b)
    np.testing.assert_array_equal(first, _run(engine, *a).images)  # no state leaks between requests
    np.testing.assert_array_equal(first, _run(_engine(flux_dev_blocks, "cache_dit", options), *a).images)
    assert engine.runner.acceleration_stats()["cache_backend"]["skipped"] > 0
    assert len(engine.runner.accelerator.backend._context_names) == 2  # double and single blocks
    assert np.abs(first - _run(_engine(flux_dev_blocks), *a).images).max() > 1e-3  # it really cached


def test_cache_dit_needs_blocks_to_cache_in_each_list(tiny_flux_dir):
    with pytest.raises(InvalidRequestError) as info:  # 2 double + 2 single blocks
        _engine(tiny_flux_dir, "cache_dit", {"Fn_compute_blocks": 2})
    assert info.value.field == "cache_config.Fn_compute_blocks"


def test_regional_compile_without_recompiles(tmp_path):
    from tiny_models import build_tiny_flux

    folder = build_tiny_flux(tmp_path / "flux", variant="dev")  # 1 block of each kind: fewer graphs
    (folder / "generation_config.json").write_text(json.dumps({"height": 32, "width": 32, "max_sequence_length": L}))
    engine = _engine(folder, compile=True, max_batch_size=2)  # warm-up at the default size, 1 and 2 rows
    eager = _engine(folder)
    jobs = [("a", _p(1, steps=2, height=32, width=32)), ("b", _p(2, steps=3, height=32, width=32,
                                                                 true_cfg_scale=2.0, negative_prompt="x"))]
    outs = engine.generate([j[0] for j in jobs], [j[1] for j in jobs])
    for out, job in zip(outs, jobs):
        assert np.abs(out.images - _run(eager, *job).images).max() <= TOL
    stats = engine.runner.acceleration_stats()["compile"]
    assert stats["enabled"] and stats["graphs_compiled"] >= 1
    assert stats["recompiles_after_warmup"] == 0


# ------------------------------------------------------------------------------- CLI
def test_cli_generate(tiny_flux_dev_dir, tmp_path, capsys):
    from PIL import Image

    rc = main(["generate", "--model", str(tiny_flux_dev_dir), "--prompt", "a cat", "--steps", "2", "--size", "48x32",
               "--guidance", "2.5", "--true-cfg-scale", "3", "--negative-prompt", "dark", "--seed", "1",
               "-o", str(tmp_path)])
    assert rc == 0, capsys.readouterr().err
    [path] = capsys.readouterr().out.split()
    assert Image.open(path).size == (48, 32)


def test_cli_refuses_guidance_on_schnell_in_one_line(tiny_flux_dir, tmp_path, capsys):
    rc = main(["generate", "--model", str(tiny_flux_dir), "--prompt", "a cat", "--guidance", "2", "-o", str(tmp_path)])
    assert rc == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("diffserve: error: argument --guidance:") and "FluxPipeline" in line


# ------------------------------------------------------------------------------ HTTP
def test_http_generation_with_flux_fields(tiny_flux_dev_dir, tiny_flux_dir):
    import base64
    import io

    import httpx
    import openai
    from PIL import Image
    from server_helpers import assert_openai_error, new_engine, serve

    from diffserve.entrypoints.openai.app import create_app

    fields = {"num_inference_steps": 2, "guidance_scale": 2.5, "true_cfg_scale": 3.0, "negative_prompt": "dark",
              "seed": 4}
    with serve(create_app(new_engine(tiny_flux_dev_dir), "flux-dev")) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
        resp = client.images.generate(prompt="a cat", model="flux-dev", size="48x32", extra_body=fields)
        served = np.asarray(Image.open(io.BytesIO(base64.b64decode(resp.data[0].b64_json))), dtype=int)
    [offline] = DiffusionEngine(EngineConfig(model=str(tiny_flux_dev_dir))).generate(
        "a cat", SamplingParams(height=32, width=48, **fields))
    assert np.abs(served - np.asarray(offline.images[0], dtype=int)).max() <= 1
    with serve(create_app(new_engine(tiny_flux_dir), "flux-schnell")) as base:
        resp = httpx.post(f"{base}/v1/images/generations", json={"prompt": "a cat", "size": "32x32",
                                                                  "guidance_scale": 2.0})
        assert_openai_error(resp, 400, "guidance_scale")
