"""Acceleration: prompt-embedding cache, cache backends (teacache, cache_dit), regional compile.

Per-request caching is checked the strong way: a request's output must not depend on what ran
before it (A, B, A) or beside it (mixed step batch vs solo run).
"""

from __future__ import annotations

import logging
import re

import numpy as np
import pytest
import torch

from diffserve import DiffusionEngine, EngineConfig, InvalidRequestError, SamplingParams
from diffserve.acceleration import compile as compile_module
from diffserve.acceleration.prompt_embed_cache import PromptEmbedCache
from diffserve.acceleration.teacache import TeaCacheBackend
from diffserve.entrypoints.cli import main
from diffserve.entrypoints.cli_args import build_parser
from diffserve.entrypoints.engine_args import engine_config_from_args

TOL = 1e-4
# Thresholds at which the tiny random model really skips (checked in the tests).
BACKENDS = {
    "teacache": {"rel_l1_thresh": 0.3},
    "cache_dit": {"Fn_compute_blocks": 1, "residual_diff_threshold": 0.5, "max_warmup_steps": 2},
    "cache_dit_taylorseer": {"Fn_compute_blocks": 1, "residual_diff_threshold": 0.5,
                             "max_warmup_steps": 2, "taylorseer": True},
}


def _backend(name: str) -> tuple[str, dict]:
    return ("cache_dit" if name.startswith("cache_dit") else name), dict(BACKENDS[name])


def _engine(model_dir, name: str | None = None, **kw) -> DiffusionEngine:
    backend, options = ("none", {}) if name is None else _backend(name)
    return DiffusionEngine(EngineConfig(model=str(model_dir), cache_backend=backend,
                                        cache_config=options, **kw))


def _p(seed, steps=10, **kw):
    return SamplingParams(seed=seed, num_inference_steps=steps, output_type="np", **kw)


def _run(engine, prompt, params):
    [out] = engine.generate(prompt, params)
    assert out.ok, out.error
    return out.images


# --------------------------------------------------------------------- prompt-embed cache
def test_prompt_cache_hit_equals_fresh_encode_and_cannot_be_mutated():
    calls = []

    def encode():
        calls.append(1)
        return torch.arange(6.0).reshape(2, 3), torch.ones(2)

    cache = PromptEmbedCache(capacity=2, model="m")
    first = cache.get_or_encode(("a",), encode)
    first[0].fill_(-1)  # the requester owns its tensors
    hit = cache.get_or_encode(("a",), encode)
    assert len(calls) == 1
    assert torch.equal(hit[0], torch.arange(6.0).reshape(2, 3)) and torch.equal(hit[1], torch.ones(2))
    hit[0].zero_()
    again = cache.get_or_encode(("a",), encode)
    assert torch.equal(again[0], torch.arange(6.0).reshape(2, 3))
    cache.get_or_encode(("b",), encode)
    cache.get_or_encode(("c",), encode)  # evicts "a" (least recently used)
    cache.get_or_encode(("a",), encode)
    assert cache.stats() | {"bytes": 0, "hit_rate": 0} == {
        "capacity": 2, "max_bytes": None, "size": 2, "bytes": 0, "hits": 2, "misses": 4, "evictions": 2,
        "hit_rate": 0}


def test_prompt_cache_is_bounded_in_bytes():
    cache = PromptEmbedCache(capacity=100, max_bytes=3 * 4 * 100)  # room for three 100-float entries

    def encode(i):
        return lambda: (torch.full((1, 100), float(i)), None)

    for i in range(5):
        cache.get_or_encode((i,), encode(i))
    stats = cache.stats()
    assert (stats["size"], stats["bytes"], stats["evictions"]) == (3, 1200, 2)
    assert cache.get_or_encode((4,), encode(99))[0][0, 0] == 4.0  # newest kept, value not re-encoded
    too_big = cache.get_or_encode(("big",), lambda: (torch.zeros(1, 1000),))
    assert too_big[0].shape == (1, 1000) and cache.stats()["size"] == 3  # larger than the bound: not stored


def test_prompt_cache_in_engine_keys_on_every_encode_argument(tiny_sd3_dir):
    engine = _engine(tiny_sd3_dir)
    uncached = _engine(tiny_sd3_dir, prompt_embed_cache_size=0)
    # one entry per distinct text (prompt or negative prompt), shared by every request and
    # repeated per image at use: (lookups, new texts) per request
    requests = [
        ("a cat", _p(1, steps=2)),                                   # "" and "a cat": 2 misses
        ("a cat", _p(2, steps=2)),                                   # 2 hits
        ("a cat", _p(1, steps=2, negative_prompt="blurry")),         # "blurry" miss, "a cat" hit
        ("a cat", _p(1, steps=2, guidance_scale=1.0)),               # CFG off: "a cat" hit
        ("a cat", _p(1, steps=2, guidance_scale=1.0, negative_prompt="x")),  # negative unused: hit
        ("a cat", _p(1, steps=2, num_images_per_prompt=2)),          # 2 hits: rows repeated at use
        ("a cat", _p(1, steps=2, max_sequence_length=64)),           # other T5 budget: 2 misses
    ]
    for prompt, params in requests:
        np.testing.assert_array_equal(_run(engine, prompt, params), _run(uncached, prompt, params))
    stats = engine.runner.acceleration_stats()["prompt_embed_cache"]
    assert (stats["hits"], stats["misses"], stats["size"]) == (7, 5, 5)
    assert uncached.runner.acceleration_stats()["prompt_embed_cache"] == {"enabled": False}


# ----------------------------------------------------------------------- cache backends
@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_cache_state_resets_between_requests(tiny_sd3_dir, name):
    engine = _engine(tiny_sd3_dir, name)
    a = ("a red house", _p(3, steps=10))
    b = ("a green tree", _p(4, steps=7, height=32, width=48))  # other step count and size
    first = _run(engine, *a)
    _run(engine, *b)
    again = _run(engine, *a)
    np.testing.assert_array_equal(first, again)
    np.testing.assert_array_equal(first, _run(_engine(tiny_sd3_dir, name), *a))  # fresh engine
    stats = engine.runner.acceleration_stats()["cache_backend"]
    assert stats["skipped"] > 0 and stats["transformer_calls"] == 27


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_mixed_step_batch_equals_solo_runs(tiny_sd3_dir, name):
    # Inline encode/decode (no side thread): the first request really runs 3 steps ahead, so
    # which requests share a forward does not depend on how fast the machine prepares them.
    engine = _engine(tiny_sd3_dir, name, overlap_stages=False)
    forwards: list[list[bool]] = []  # teacache: each forward's per-request compute decisions
    if name == "teacache":
        backend = engine.runner.accelerator.backend
        denoise, decide = backend.denoise, backend._decide

        def recording_denoise(adapter, batch):
            forwards.append([])
            return denoise(adapter, batch)

        def recording_decide(st, modulated, layout):
            result = decide(st, modulated, layout)
            if result is not None:  # None: decided once the embedding ran
                forwards[-1].append(result.compute)
            return result

        backend.denoise, backend._decide = recording_denoise, recording_decide
    jobs = [("one", _p(11, steps=12)), ("two", _p(12, steps=9)), ("three", _p(13, steps=10))]
    ids = [engine.add_request(*jobs[0])]
    for _ in range(3):  # the first request runs ahead: later steps share forwards with others
        engine.step()
    ids += [engine.add_request(*job) for job in jobs[1:]]
    outputs = {}
    while engine.has_unfinished_requests():
        for event in engine.step():
            if event.type.is_final:
                outputs[event.request_id] = event.output
    for request_id, job in zip(ids, jobs):
        assert np.abs(outputs[request_id].images - _run(_engine(tiny_sd3_dir, name), *job)).max() <= TOL
    if name == "teacache":
        assert any(any(d) and not all(d) for d in forwards), "no forward mixed compute and reuse"
        assert max(outputs[ids[0]].metrics.batch_sizes) == 6  # really batched
    else:  # cache_dit runs one request per forward
        assert set(outputs[ids[0]].metrics.batch_sizes) == {2}


def test_teacache_skips_more_with_a_higher_threshold(tiny_sd3_dir):
    skipped = []
    for thresh in (0.1, 0.3, 1.0):
        engine = DiffusionEngine(EngineConfig(model=str(tiny_sd3_dir), cache_backend="teacache",
                                              cache_config={"rel_l1_thresh": thresh}))
        _run(engine, "a kite", _p(6, steps=12))
        skipped.append(engine.runner.acceleration_stats()["cache_backend"]["skipped"])
    assert skipped == sorted(skipped) and skipped[-1] > skipped[0]
    assert skipped[-1] <= 12 - 2  # first and last steps always compute
    assert isinstance(engine.runner.accelerator.backend, TeaCacheBackend)


def test_teacache_picks_the_calibrated_preset_per_model(tiny_sd3_dir):
    import json

    from diffserve.models.digits import DEFAULT_MODEL_PATH

    # the calibration diffserve calibrate-cache wrote, over generation_config.json's threshold
    shipped = json.loads((DEFAULT_MODEL_PATH / "diffserve_cache.json").read_text())["teacache"]
    threshold = json.loads((DEFAULT_MODEL_PATH / "generation_config.json").read_text())["teacache"]["rel_l1_thresh"]
    default = DiffusionEngine(EngineConfig(cache_backend="teacache"))  # the built-in digits model
    backend = default.runner.accelerator.backend
    assert backend.coefficients == tuple(shipped["coefficients"])
    assert {name: backend.levels[name].budget for name in shipped["cache_quality"]} == \
        {name: level["budget"] for name, level in shipped["cache_quality"].items()}
    assert default.runner.acceleration_stats()["cache_backend"]["rel_l1_thresh"] == threshold
    other = DiffusionEngine(EngineConfig(model=str(tiny_sd3_dir), cache_backend="teacache"))
    assert "TeaCache4FLUX" in other.runner.acceleration_stats()["cache_backend"]["coefficients_source"]


# ----------------------------------------------------------------------------- compile
def test_compile_failure_falls_back_to_eager(tiny_sd3_dir, monkeypatch, caplog):
    def broken_backend(gm, example_inputs):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(compile_module, "COMPILE_BACKEND", broken_backend)
    engine = _engine(tiny_sd3_dir, compile=True)
    stats = engine.runner.acceleration_stats()["compile"]
    assert stats["enabled"] is False and "no compiler here" in stats["fallback_reason"]
    assert "running eagerly" in caplog.text
    job = ("a fox", _p(7, steps=3))
    np.testing.assert_array_equal(_run(engine, *job), _run(_engine(tiny_sd3_dir), *job))


def test_regional_compile_matches_eager_without_recompiles(tmp_path_factory, caplog):
    from tiny_models import build_tiny_sd3

    one_block = build_tiny_sd3(tmp_path_factory.mktemp("tiny_sd3_1"), num_layers=1)
    with caplog.at_level(logging.INFO, logger="diffserve.acceleration.compile"):
        engine = _engine(one_block, compile=True, max_batch_size=6)
    # what is compiled, then how long the warm-up took (a silent 10-45 s start otherwise)
    assert "torch.compile (backend inductor, dynamic shapes): 1 x JointTransformerBlock of SD3Transformer2DModel" \
        in caplog.text
    assert re.search(r"torch.compile: warm-up of \d+ forward\(s\) took \d+\.\d s \(\d+ graph\(s\) compiled\)",
                     caplog.text)
    eager = _engine(one_block)
    jobs = [("a", _p(1, steps=3)), ("b", _p(2, steps=4, guidance_scale=1.0)), ("c", _p(3, steps=5))]
    outs = engine.generate([j[0] for j in jobs], [j[1] for j in jobs])  # 5, 3 and 2 rows
    for out, job in zip(outs, jobs):
        assert np.abs(out.images - _run(eager, *job)).max() <= TOL
    stats = engine.runner.acceleration_stats()["compile"]
    assert stats["enabled"] and stats["graphs_compiled"] >= 1
    assert stats["recompiles_after_warmup"] == 0


# ------------------------------------------------------------------------ config and CLI
def _cli_config(*flags):
    args = build_parser().parse_args(["generate", "--prompt", "x", *flags])
    return engine_config_from_args(args)


def test_cli_flags_reach_the_engine_config():
    default = _cli_config()
    assert (default.cache_backend, default.cache_config, default.compile, default.prompt_embed_cache_size) == \
        ("none", {}, False, 256)
    config = _cli_config("--cache-backend", "teacache", "--cache-config", '{"rel_l1_thresh": 0.2}',
                         "--compile", "--compile-vae", "--prompt-embed-cache-size", "0")
    assert (config.cache_backend, config.cache_config, config.compile, config.compile_vae,
            config.prompt_embed_cache_size) == ("teacache", {"rel_l1_thresh": 0.2}, True, True, 0)
    assert _cli_config("--cache-backend", "cache_dit").cache_backend == "cache_dit"
    assert _cli_config("--enforce-eager").compile is False


def test_cli_compile_shows_the_compile_log(tmp_path, monkeypatch, capsys):
    """``--compile`` turns the compile logger's INFO lines on in the CLI (its default level is
    WARNING), so the start-up says what it compiles and how long it took (the lines themselves:
    the regional compile test). Checked on a run that stops at a bad flag: no compile needed."""
    logger = logging.getLogger("diffserve.acceleration.compile")
    monkeypatch.setattr(logger, "level", logging.NOTSET)
    assert main(["generate", "x", "-o", str(tmp_path), "--steps", "0"]) == 2
    assert logger.getEffectiveLevel() == logging.WARNING
    assert main(["generate", "x", "-o", str(tmp_path), "--steps", "0", "--compile"]) == 2
    assert logger.getEffectiveLevel() == logging.INFO


@pytest.mark.parametrize("name", ["none", "teacache", "cache_dit"])
def test_cli_generate_with_each_backend(tiny_sd3_dir, tmp_path, name, capsys):
    extra = [] if name == "none" else ["--cache-config", '{"rel_l1_thresh": 0.3}' if name == "teacache"
                                       else '{"Fn_compute_blocks": 1}']
    code = main(["generate", "--model", str(tiny_sd3_dir), "--prompt", "a dog", "--steps", "3",
                 "--seed", "1", "-o", str(tmp_path), "--cache-backend", name, *extra])
    assert code == 0, capsys.readouterr().err
    assert len(list(tmp_path.glob("*.png"))) == 1


@pytest.mark.parametrize("flags,fragment", [
    (["--cache-backend", "fastest"], "invalid choice"),
    (["--cache-backend", "teacache", "--cache-config", "{bad json"], "argument --cache-config: invalid value"),
    (["--cache-backend", "teacache", "--cache-config", '{"threshold": 1}'], "argument --cache-config: invalid"),
    (["--compile", "--enforce-eager"], "not allowed with"),
    (["--prompt-embed-cache-size", "-1"], "argument --prompt-embed-cache-size: invalid value -1"),
])
def test_cli_rejects_bad_acceleration_flags(tiny_sd3_dir, tmp_path, flags, fragment, capsys):
    try:
        code = main(["generate", "--model", str(tiny_sd3_dir), "--prompt", "x", "-o", str(tmp_path), *flags])
    except SystemExit as exc:  # argparse errors
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert fragment in err and err.count("\n") == 1


@pytest.mark.parametrize("fields,field", [
    ({"cache_backend": "magic"}, "cache_backend"),
    ({"cache_backend": "teacache", "cache_config": {"rel_l1_thresh": -1}}, "cache_config.rel_l1_thresh"),
    ({"cache_backend": "teacache", "cache_config": {"warmup_steps": 0}}, "cache_config.warmup_steps"),
    ({"cache_backend": "teacache", "cache_config": {"family": "flux"}}, "cache_config"),
    ({"cache_backend": "cache_dit", "cache_config": {"Fn_compute_blocks": 0}}, "cache_config.Fn_compute_blocks"),
    ({"cache_backend": "cache_dit", "cache_config": {"taylorseer": "yes"}}, "cache_config.taylorseer"),
    ({"cache_backend": "cache_dit", "cache_config": {"bogus": 1}}, "cache_config"),
    ({"cache_backend": "none", "cache_config": {"rel_l1_thresh": 0.1}}, "cache_config"),
    ({"cache_config": [1]}, "cache_config"),
    ({"prompt_embed_cache_size": 1.5}, "prompt_embed_cache_size"),
    ({"compile": "yes"}, "compile"),
])
def test_bad_acceleration_config_names_the_field(fields, field):
    with pytest.raises(InvalidRequestError) as info:
        EngineConfig(**fields)
    assert info.value.field == field


def test_cache_dit_rejects_fn_bn_covering_every_block(tiny_sd3_dir):
    with pytest.raises(InvalidRequestError) as info:  # the tiny model has 2 blocks
        DiffusionEngine(EngineConfig(model=str(tiny_sd3_dir), cache_backend="cache_dit",
                                     cache_config={"Fn_compute_blocks": 2}))
    assert info.value.field == "cache_config.Fn_compute_blocks"


# ---------------------------------------------------------------- context folding
def test_context_folding_matches_full_context(tiny_sd3_dir, tiny_sd3_t5_dir):
    """Folding the 256 zero T5 placeholder rows into one token changes no pixel beyond 1e-4,
    shortens the text sequence, and is not applied when a real T5 is present."""
    from diffserve import DiffusionEngine, EngineConfig, SamplingParams

    params = [SamplingParams(seed=s, num_inference_steps=3, guidance_scale=g, output_type="np")
              for s, g in ((1, 4.0), (2, 1.0))]
    folded = DiffusionEngine(EngineConfig(model=str(tiny_sd3_dir)))
    full = DiffusionEngine(EngineConfig(model=str(tiny_sd3_dir), context_folding=False))
    assert folded.runner.adapter.text.encode("a cat", 256)[0].shape[1] == 77 + 1
    assert full.runner.adapter.text.encode("a cat", 256)[0].shape[1] == 77 + 256
    for a, b in zip(folded.generate(["a cat", "a dog"], params), full.generate(["a cat", "a dog"], params)):
        assert np.abs(a.images - b.images).max() <= 1e-4
    with_t5 = DiffusionEngine(EngineConfig(model=str(tiny_sd3_t5_dir)))
    assert not with_t5.runner.adapter.context_folding
    assert with_t5.runner.acceleration_stats()["context_folding"] == {"enabled": False}


@pytest.mark.parametrize("folder, cache_size", [("tiny_sd3_t5_dir", 0), ("tiny_sd3_t5_dir", 256),
                                                 ("tiny_flux_dir", 256), ("tiny_sd15_dir", 256),
                                                 ("tiny_sdxl_dir", 256)])
def test_requests_prepared_together_share_one_encoder_forward(folder, cache_size, request):
    """Requests admitted together have their new texts (prompts and the shared negative
    prompt) encoded in ONE batched call, and each gets the rows it gets alone."""
    from diffserve import DiffusionEngine, EngineConfig

    model = request.getfixturevalue(folder)
    engine = DiffusionEngine(EngineConfig(model=str(model), prompt_embed_cache_size=cache_size))
    text = engine.runner.adapter.text
    calls = []
    encode = text._encode
    text._encode = lambda texts, *a, **kw: calls.append(texts) or encode(texts, *a, **kw)
    # a set negative prompt: Flux runs CFG only with one, SDXL zeroes an unset one
    cfg = {"true_cfg_scale": 3.0, "negative_prompt": ""} if "flux" in folder else {"negative_prompt": ""}
    prompts = ["a red fox", "a blue bird", "a red fox"]
    params = [_p(seed, steps=2, **cfg) for seed in (1, 2, 3)]
    outs = engine.generate(prompts, params)
    assert all(o.ok for o in outs), [o.error for o in outs]
    assert calls == [["a red fox", "", "a blue bird"]]  # the distinct texts, in one call
    alone = DiffusionEngine(EngineConfig(model=str(model), prompt_embed_cache_size=0))
    for prompt, p, out in zip(prompts, params, outs):
        [want] = alone.generate(prompt, p)
        assert np.abs(out.images - want.images).max() <= 1e-5


def test_failed_batched_encoding_falls_back_to_one_text_at_a_time(tiny_sd3_t5_dir):
    from diffserve import DiffusionEngine, EngineConfig

    engine = DiffusionEngine(EngineConfig(model=str(tiny_sd3_t5_dir)))
    text = engine.runner.adapter.text
    encode = text._encode

    def no_lists(texts, *a, **kw):
        if isinstance(texts, list):
            raise RuntimeError("batched encode broke")
        return encode(texts, *a, **kw)

    text._encode = no_lists
    outs = engine.generate(["a red fox", "a blue bird"], [_p(1, steps=2), _p(2, steps=2)])
    assert all(o.ok for o in outs), [o.error for o in outs]
    text._encode = encode
    [want] = engine.generate("a blue bird", _p(2, steps=2))
    assert np.abs(outs[1].images - want.images).max() <= 1e-5  # (it ran batched with the fox, this alone)


def test_cuda_graphs_are_refused_without_a_cuda_device(tiny_sd3_dir):
    """CUDA graphs replay recorded GPU kernels: a CPU engine refuses the option by name (the
    replays themselves are tested on a CUDA device: tests/acceleration/test_cuda_graphs.py)."""
    with pytest.raises(InvalidRequestError, match="cuda_graphs.*CUDA device"):
        DiffusionEngine(EngineConfig(model=str(tiny_sd3_dir), device="cpu", cuda_graphs=True))


def test_teacache_state_is_not_advanced_twice_when_a_shared_step_is_retried(tiny_sd3_dir, monkeypatch):
    """A shared step that fails after its forward is retried request by request; the healthy
    request's TeaCache state is put back first, so it ends as its solo run."""
    engine = _engine(tiny_sd3_dir, "teacache", overlap_stages=False)
    adapter = engine.runner.adapter
    step = adapter.step

    def failing_step(batch, guided):
        if any(s.prompt == "bad" and s.step_index == 3 for s in batch.states):
            raise RuntimeError("injected")
        return step(batch, guided)

    monkeypatch.setattr(adapter, "step", failing_step)
    job = ("a red house", _p(3, steps=10))
    good, bad = engine.generate([job[0], "bad"], [job[1], _p(4, steps=10)])
    assert good.ok and bad.status == "failed"
    assert np.abs(good.images - _run(_engine(tiny_sd3_dir, "teacache"), *job)).max() <= TOL
    # the good request's 10 steps; the bad one's 3 shared steps and the forward of its failing retry
    assert engine.runner.acceleration_stats()["cache_backend"]["transformer_calls"] == 10 + 3 + 1
