"""FluxPipeline (schnell and dev layouts) quirks: diffusers' true-CFG rule, packed latents, the
text length in the batch key, defaults, bad values, cache-dit's two block lists, regional compile,
CLI and HTTP fields. (Parity, batching with embedded guidance and true CFG, refusals of unused
fields and both cache backends on each layout: tests/conformance/.)"""

from __future__ import annotations

import json

import numpy as np
import pytest
from diffusers import FluxPipeline

from diffserve import DiffusionEngine, EngineConfig, InvalidRequestError, SamplingParams
from diffserve.entrypoints.cli import main
from seeds import image_generators

TOL = 1e-4
SIZE = dict(height=64, width=48)
L = 32  # max_sequence_length: short T5 text keeps the tiny forwards cheap


@pytest.fixture(scope="module")
def schnell(tiny_flux_dir):
    return DiffusionEngine(EngineConfig(model=str(tiny_flux_dir)))


@pytest.fixture(scope="module")
def dev(tiny_flux_dev_dir):
    return DiffusionEngine(EngineConfig(model=str(tiny_flux_dev_dir)))


def _p(seed, steps=3, **kw):
    return SamplingParams(seed=seed, num_inference_steps=steps, **{"output_type": "np", "max_sequence_length": L,
                                                                    **SIZE, **kw})


def _run(engine, prompt, params):
    [out] = engine.generate(prompt, params)
    assert out.ok, out.error
    return out


# ------------------------------------------------------------------------------ parity
CASES = {  # id: (steps, guidance_scale, true_cfg_scale, negative_prompt, images, forward rows)
    "true-cfg-empty-negative-n2": (2, 5.0, 3.0, "", 2, 4),  # an empty negative prompt is one
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
    ref = pipe("a photo of a cat", generator=image_generators(7, n), output_type="np", **kw).images
    out = _run(engine, "a photo of a cat", SamplingParams(seed=7, output_type="np", **kw))
    assert out.images.shape == ref.shape == (n, 64, 48, 3)
    assert np.abs(out.images - ref).max() <= 1e-5  # measured: 0 without true CFG, ~1e-6 with
    assert out.metrics.batch_sizes == {rows: steps}  # one forward per step; true CFG doubles rows


def test_latent_output_is_packed_like_diffusers(dev):
    out = _run(dev, "a cat", _p(3, steps=1, output_type="latent"))
    assert out.images.shape == (1, (64 // 16) * (48 // 16), 64)


# -------------------------------------------------------------------- step batching
def test_sequence_length_decides_the_batch_and_sizes_mix(dev):
    """The T5 length is in the batch key; sizes are not (`FluxAdapter.mixed_sizes`)."""
    jobs = [("a", _p(1)), ("b", _p(2, max_sequence_length=16)), ("c", _p(3, height=32, width=32))]
    outs = dev.generate([j[0] for j in jobs], [j[1] for j in jobs])
    assert [max(o.metrics.batch_sizes) for o in outs] == [2, 1, 2]
    assert outs[2].images.shape == (1, 32, 32, 3)
    for out, job in zip(outs, jobs):
        assert np.abs(out.images - _run(dev, *job).images).max() <= TOL


def test_same_token_count_other_grid_gets_its_own_positions(dev):
    """32x64 and 64x32 pack to the same number of tokens (equal latent shapes, no padding):
    the rows still differ in their RoPE ids, and each equals its solo run."""
    jobs = [("a red kite", _p(5, height=32, width=64)), ("a blue boat", _p(6, height=64, width=32, steps=2))]
    outs = dev.generate([j[0] for j in jobs], [j[1] for j in jobs])
    assert [max(o.metrics.batch_sizes) for o in outs] == [2, 2]
    for out, job in zip(outs, jobs):
        assert out.images.shape[1:3] == (job[1].height, job[1].width)
        assert np.abs(out.images - _run(dev, *job).images).max() <= TOL


def test_no_mixed_sizes_batches_flux_by_size(tiny_flux_dev_dir):
    engine = DiffusionEngine(EngineConfig(model=str(tiny_flux_dev_dir), mixed_sizes=False))
    outs = engine.generate(["a", "c"], [_p(1), _p(3, height=32, width=32)])
    assert [max(o.metrics.batch_sizes) for o in outs] == [1, 1]


# ---------------------------------------------------------------- spec and refusals
def test_defaults_follow_diffusers(schnell, dev):
    spec = dev.spec
    assert (spec.default_num_inference_steps, spec.default_guidance_scale, spec.default_true_cfg_scale,
            spec.default_max_sequence_length, spec.default_height, spec.default_width,
            spec.resolution_factor) == (28, 3.5, 1.0, 512, 1024, 1024, 16)
    assert schnell.spec.default_guidance_scale is None  # no guidance embedding


@pytest.mark.parametrize("fields,field", [
    ({"max_sequence_length": 513}, "max_sequence_length"),  # diffusers' limit: 512
    ({"height": 40}, "height"),                    # not a multiple of 16
])
def test_bad_fields_are_refused_by_name(schnell, fields, field):
    with pytest.raises(InvalidRequestError) as info:
        schnell.generate("a cat", SamplingParams(**fields))
    assert info.value.field == field


# ------------------------------------------------------------------------ acceleration
def _engine(folder, backend="none", options=None, **kw):
    return DiffusionEngine(EngineConfig(model=str(folder), cache_backend=backend, cache_config=options or {}, **kw))


def test_cache_dit_with_taylorseer_caches_both_block_lists_per_request(tiny_flux_dev_dir, dev):
    options = {"Fn_compute_blocks": 1, "residual_diff_threshold": 1e9, "max_warmup_steps": 2, "taylorseer": True}
    engine = _engine(tiny_flux_dev_dir, "cache_dit", options)
    a, b = ("a red house", _p(3, steps=8)), ("a green tree", _p(4, steps=5, height=32, width=32, true_cfg_scale=3.0,
                                                                negative_prompt="x"))
    first = _run(engine, *a).images
    _run(engine, *b)
    np.testing.assert_array_equal(first, _run(engine, *a).images)  # no state leaks between requests
    np.testing.assert_array_equal(first, _run(_engine(tiny_flux_dev_dir, "cache_dit", options), *a).images)
    assert engine.runner.acceleration_stats()["cache_backend"]["skipped"] > 0
    assert len(engine.runner.accelerator.backend._context_names) == 2  # double and single blocks
    assert np.abs(first - _run(dev, *a).images).max() > 1e-3  # it really cached


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
    jobs = [("a", _p(1, steps=2, height=32, width=32)), ("c", _p(3, steps=2, height=48, width=32)),
            ("b", _p(2, steps=3, height=32, width=32, true_cfg_scale=2.0, negative_prompt="x"))]
    outs = engine.generate([j[0] for j in jobs], [j[1] for j in jobs])
    assert max(outs[1].metrics.batch_sizes) == 2  # "a" and "c": one mixed-size forward
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


def test_mixed_sizes_with_lora_rows_and_teacache(tiny_flux_dev_dir, tmp_path, monkeypatch):
    """A LoRA request of one size and a plain request of another share forwards under TeaCache:
    when only one of them computes its blocks (`narrowed_rows`), the per-row positions, masks and
    adapters follow the computed rows, and each equals its run alone."""
    from tiny_models.loras import random_lora, save_diffusers_lora

    from diffserve.acceleration import teacache

    pipe = FluxPipeline.from_pretrained(tiny_flux_dev_dir)
    lora = save_diffusers_lora(FluxPipeline, tmp_path / "a", {"transformer": (
        random_lora(pipe.transformer, ("to_q", "to_k", "to_v", "to_out.0"), 2, seed=3), 2, 2.0)})
    engine = _engine(tiny_flux_dev_dir, "teacache", {"rel_l1_thresh": 100.0}, loras={"a": str(lora)},
                     overlap_stages=False)
    small = _p(1, steps=4, height=32, width=48, loras={"a": 1.0}, true_cfg_scale=2.0, negative_prompt="x")
    large = _p(2, steps=8, height=64, width=48, true_cfg_scale=3.0, negative_prompt="y")
    subsets = []
    narrowed_rows = teacache.narrowed_rows
    monkeypatch.setattr(teacache, "narrowed_rows", lambda index: subsets.append(list(index)) or narrowed_rows(index))
    together = engine.generate(["a cat", "a dog"], [small, large])
    monkeypatch.setattr(teacache, "narrowed_rows", narrowed_rows)
    assert max(together[0].metrics.batch_sizes) == 4
    assert subsets and all(len(rows) == 2 for rows in subsets)  # one request's two CFG rows computed alone
    alone = [_run(engine, "a cat", small), _run(engine, "a dog", large)]
    for t, a in zip(together, alone):
        assert np.abs(t.images - a.images).max() <= TOL


def test_teacache_levels_survive_a_batch_that_changes_padding(tiny_flux_dev_dir):
    """A request whose batch-mate of a larger size finishes first runs on at its own sequence
    length: its forecasts (TeaCache's default level, cached in the padded layout) are not
    reused across the change."""
    engine = _engine(tiny_flux_dev_dir, "teacache", overlap_stages=False)
    small = _p(1, steps=12, height=32, width=32)
    large = _p(2, steps=4, height=64, width=48)
    together = engine.generate(["a cat", "a dog"], [small, large])
    assert all(o.ok for o in together), [o.error for o in together]
    assert together[0].images.shape == (1, 32, 32, 3)
