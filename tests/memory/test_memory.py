"""Memory: model CPU offload, layerwise offload, sleep mode, memory-aware admission, per-request
peak memory (CPU: the "device" is the CPU itself, so offload shows its mechanics and exact
outputs; sleep shows real RSS drops)."""

from __future__ import annotations

import json
import shutil
import threading
import time

import numpy as np
import pytest
from fastapi.testclient import TestClient

from diffserve import AsyncDiffusionEngine, DiffusionEngine, EngineConfig, InvalidRequestError, SamplingParams
from diffserve.core.memory_size import parse_memory
from diffserve.entrypoints.cli_args import build_parser
from diffserve.entrypoints.engine_args import engine_config_from_args
from diffserve.entrypoints.openai.app import create_app
from diffserve.core.errors import EngineSleepingError
from diffserve.memory.accounting import release_host_memory, rss_bytes

TOL = 1e-5

JOBS = [  # different prompts, seeds, step counts, CFG on and off: they share steps
    ("a red fox", SamplingParams(seed=1, num_inference_steps=4, output_type="np")),
    ("a blue bird", SamplingParams(seed=2, num_inference_steps=6, output_type="np", guidance_scale=1.0)),
    ("a green tree", SamplingParams(seed=3, num_inference_steps=5, output_type="np", num_images_per_prompt=2)),
]


def _images(engine, jobs=JOBS):
    outs = engine.generate([p for p, _ in jobs], [s for _, s in jobs])
    assert all(o.ok for o in outs), [o.error for o in outs]
    return [o.images for o in outs], outs


def _engine(model_dir, **kw) -> DiffusionEngine:
    return DiffusionEngine(EngineConfig(model=str(model_dir), **kw))


@pytest.fixture(scope="module")
def plain_images(engine):
    return _images(engine)[0]


# ------------------------------------------------------------------------------- offload
@pytest.mark.parametrize("mode, options", [
    ("model", {"cpu_offload": True}),
    ("layerwise", {"layerwise_offload": True}),
    ("model+layerwise", {"layerwise_offload": True, "offload_blocks": 2, "cpu_offload": True}),
])
def test_each_offload_mode_equals_the_plain_engine(tiny_sd3_dir, plain_images, mode, options):
    engine = _engine(tiny_sd3_dir, **options)
    images, _ = _images(engine)
    for got, want in zip(images, plain_images):
        assert np.abs(got - want).max() <= TOL
    stats = engine.stats()["offload"]
    assert stats["mode"] == mode
    if options.get("layerwise_offload"):  # diffusers' group offloading hooks on the blocks
        transformer = engine.runner.adapter.denoiser
        blocks = len(transformer.transformer_blocks)
        assert stats["layerwise"]["groups"] == -(-blocks // options.get("offload_blocks", 1))
        assert transformer.transformer_blocks[0]._diffusers_hook.get_hook("group_offloading") is not None
        assert stats["layerwise"]["stream"] is False  # no streams on a CPU


def test_model_offload_moves_each_stage_once_per_work_item(tiny_sd3_dir):
    """Requests admitted together are encoded with one move of the text encoders, stepped with
    one move of the denoiser and decoded with one move of the VAE; each request reports the
    moves made for its work items."""
    engine = _engine(tiny_sd3_dir, cpu_offload=True, overlap_stages=False)
    offload = engine.runner.memory.offload
    assert offload.resident == set()  # everything starts on the CPU (home)
    jobs = [(f"prompt {i}", SamplingParams(seed=i, num_inference_steps=3, output_type="np")) for i in range(4)]
    _, outs = _images(engine, jobs)
    stages = offload.stages
    moves = len(stages["encode"]) + len(stages["denoise"]) + len(stages["decode"])
    assert moves == 4  # two CLIP encoders, the transformer, the VAE
    assert [o.metrics.offload_loads for o in outs] == [moves] * len(outs)
    assert engine.stats()["offload"]["loads"] == moves  # not one per request
    assert offload.resident == {"vae"}  # the denoiser left once nothing was denoising


def test_model_offload_keeps_the_denoiser_while_requests_denoise(tiny_sd3_dir):
    """Short requests arriving and finishing while a long one denoises move the encoders and
    the VAE in and out, never the denoiser (no thrashing between interleaved requests)."""
    engine = _engine(tiny_sd3_dir, cpu_offload=True, overlap_stages=False)
    offload = engine.runner.memory.offload
    loads: dict[str, int] = {}
    original = offload._ensure

    def count(names):
        for name in names:
            if name not in offload.resident:
                loads[name] = loads.get(name, 0) + 1
        return original(names)

    offload._ensure = count
    long_id = engine.add_request("a long one", SamplingParams(seed=0, num_inference_steps=30, output_type="np"))
    finished = set()
    for step in range(200):
        if step in (3, 12):
            engine.add_request(f"short {step}", SamplingParams(seed=step, num_inference_steps=2, output_type="np"))
        finished |= {e.request_id for e in engine.step() if e.type.is_final}
        if long_id in finished and len(finished) == 3:
            break
    assert len(finished) == 3
    assert loads["transformer"] == 1
    assert loads["vae"] == 2 and loads["text_encoder"] == 3  # in for each short request's decode / encode


# ------------------------------------------------------------------------------- sleep
@pytest.fixture(scope="module")
def dummy_sd3_dir(tiny_sd3_dir, tmp_path_factory):
    """The tiny SD3 folder with a 227 MiB transformer (3 blocks of width 768) and no
    transformer weight file: load it with ``load_format="dummy"``."""
    out = tmp_path_factory.mktemp("sd3_227mib") / "model"
    shutil.copytree(tiny_sd3_dir, out)
    config_path = out / "transformer" / "config.json"
    config = json.loads(config_path.read_text())
    config.update(num_layers=3, attention_head_dim=64, num_attention_heads=12, caption_projection_dim=768)
    config_path.write_text(json.dumps(config))
    for weights in (out / "transformer").glob("*.safetensors"):
        weights.unlink()
    return out


def _sleep_cycle(engine, level, job):
    """Sleep at `level` and wake up; returns (RSS drop while asleep in bytes, images after)."""
    release_host_memory()
    awake = rss_bytes()
    engine.sleep(level)
    release_host_memory()
    asleep = rss_bytes()
    assert engine.is_sleeping and engine.sleep_level == level
    with pytest.raises(EngineSleepingError):
        engine.generate(*job)
    engine.wake_up()
    assert not engine.is_sleeping
    [out] = engine.generate(*job)
    assert out.ok, out.error
    return awake - asleep, out.images


def test_sleep_frees_the_weights_and_wake_restores_identical_outputs(dummy_sd3_dir):
    """Level 2 discards the weights (RSS drops by at least their size) and reloads them from
    the folder (dummy: the same seeded weights); level 1 spills them to disk (the device IS the
    CPU here) and reads them back. Outputs after waking are byte-identical.

    Each level is measured on its second cycle: the first run of a code path allocates
    interpreter and library state (~50 KiB here) that is not the weights."""
    engine = _engine(dummy_sd3_dir, load_format="dummy", enable_sleep_mode=True)
    job = ("a cat", SamplingParams(seed=3, num_inference_steps=2, output_type="np"))
    [out] = engine.generate(*job)
    before = out.images
    weights = sum(engine.runner.memory.offload.bytes.values())
    assert weights > 200 * 2**20
    for level in (2, 1):
        engine.sleep(level)  # first run of this level's code path
        engine.wake_up()
        dropped, images = _sleep_cycle(engine, level, job)
        assert np.array_equal(images, before), level
        assert dropped >= weights, (level, dropped, weights)
        assert engine.runner.memory.sleeper._spill is None  # the level-1 spill folder is gone


def test_sleep_lets_in_flight_requests_finish_and_refuses_new_ones(tiny_sd3_dir):
    engine = _engine(tiny_sd3_dir)
    job = ("a fox", SamplingParams(seed=5, num_inference_steps=40, output_type="np"))
    [want] = engine.generate(*job)
    results = []
    thread = threading.Thread(target=lambda: results.extend(engine.generate(*[[job[0]] * 3, job[1]])))
    thread.start()
    deadline = time.monotonic() + 30
    while engine.num_running_rows == 0:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    engine.sleep(1)  # blocks until the three requests are done
    thread.join(timeout=30)
    assert [o.ok for o in results] == [True] * 3
    for out in results:
        assert np.abs(out.images - want.images).max() <= 1e-4
    with pytest.raises(EngineSleepingError):
        engine.add_request("late", job[1])
    engine.sleep(2)  # deepens: the kept copies are dropped too
    assert engine.sleep_level == 2
    with pytest.raises(InvalidRequestError, match="level"):
        engine.sleep(3)
    engine.wake_up()
    [again] = engine.generate(*job)
    assert np.array_equal(again.images, want.images)


def test_sleep_with_offload_and_without_pool(tiny_sd3_dir, plain_images):
    engine = _engine(tiny_sd3_dir, cpu_offload=True, layerwise_offload=True)
    for level in (1, 2):
        engine.sleep(level)
        engine.wake_up()
        images, _ = _images(engine)
        for got, want in zip(images, plain_images):
            assert np.abs(got - want).max() <= TOL
    transformer = engine.runner.adapter.denoiser
    assert transformer.transformer_blocks[0]._diffusers_hook.get_hook("group_offloading") is not None


def test_sleep_routes(tiny_sd3_dir):
    """POST /sleep, GET /is_sleeping, 503 + Retry-After while asleep, POST /wake_up, 400 for a
    bad level; with wake_on_request a generation request wakes the engine."""
    body = {"prompt": "a cat", "size": "64x64", "num_inference_steps": 2, "seed": 1}
    for wake_on_request in (False, True):
        engine = AsyncDiffusionEngine(EngineConfig(model=str(tiny_sd3_dir), num_threads=1))
        app = create_app(engine, "tiny", wake_on_request=wake_on_request, enable_sleep_mode=True)
        with TestClient(app) as client:
            assert client.post("/v1/images/generations", json=body).status_code == 200
            assert client.get("/is_sleeping").json() == {"is_sleeping": False}
            bad = client.post("/sleep", params={"level": 3})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "level"
            assert client.post("/sleep", params={"level": 2}).json() == {"is_sleeping": True, "level": 2}
            assert client.get("/is_sleeping").json() == {"is_sleeping": True}
            resp = client.post("/v1/images/generations", json=body)
            if wake_on_request:
                assert resp.status_code == 200 and not engine.is_sleeping
            else:
                assert resp.status_code == 503 and resp.headers["Retry-After"]
                assert resp.json()["error"]["code"] == "engine_sleeping"
                assert client.post("/wake_up").json() == {"is_sleeping": False}
                assert client.post("/v1/images/generations", json=body).status_code == 200


def test_sleep_routes_need_the_api_key_and_refuse_other_sites(tiny_sd3_dir):
    """With --api-key, POST /sleep and /wake_up need the key like /v1/*; a page of another
    site cannot post them (403, no CORS preflight protects a body-less POST); GET /is_sleeping
    stays open like /health."""
    engine = AsyncDiffusionEngine(EngineConfig(model=str(tiny_sd3_dir), num_threads=1))
    app = create_app(engine, "tiny", api_key="secret", enable_sleep_mode=True)
    key = {"Authorization": "Bearer secret"}
    with TestClient(app) as client:
        for path in ("/sleep", "/wake_up"):
            refused = client.post(path)
            assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
            other_site = client.post(path, headers={**key, "Origin": "http://evil.example"})
            assert other_site.status_code == 403 and other_site.json()["error"]["code"] == "cross_origin_forbidden"
        assert client.get("/is_sleeping").json() == {"is_sleeping": False}
        own = {**key, "Origin": "http://testserver"}  # the server's own page (its Host)
        assert client.post("/sleep", headers=own).json() == {"is_sleeping": True, "level": 1}
        assert client.post("/wake_up", headers=key).json() == {"is_sleeping": False}


# ------------------------------------------------------------------- memory-aware admission
@pytest.fixture(scope="module")
def profiled(tiny_sd3_dir):
    """An engine with a generous max_memory (its runner's profile is measured once and
    reused by the engines of the tests below)."""
    return _engine(tiny_sd3_dir, max_memory="64GiB", overlap_stages=False)


def _budget_engine(profiled, tiny_sd3_dir, requests_that_fit: float, **kw) -> DiffusionEngine:
    profile = profiled.memory_budget.profile
    params = JOBS[0][1].resolve(profiled.spec, profiled.config.limits, 0)
    cost = profiled.memory_budget.request_bytes(params, 2)
    limit = profile.weight_bytes + profile.reserve_bytes + int(requests_that_fit * cost)
    config = EngineConfig(model=str(tiny_sd3_dir), max_memory=limit, overlap_stages=False, **kw)
    return DiffusionEngine(config, runner=profiled.runner)


def test_memory_profile_is_measured(profiled):
    profile = profiled.memory_budget.profile
    assert profile.weight_bytes == sum(profiled.runner.memory.offload.bytes.values())
    # per-row bytes were measured (the tiny model's ~170 KB per row is near RSS noise, so the
    # two sizes' points may fit a flat line: then per_pixel is 0 and the base carries it)
    assert profile.reserve_bytes > 0 and profile.row_bytes_base + profile.row_bytes_per_pixel * 64 * 64 > 0
    assert profile.row_bytes_per_pixel >= 0
    assert len(profile.points) == 2 and profile.method == "process RSS high-water mark"
    small, large = (profile.request_bytes(h, h, 2, 1) for h in (32, 128))
    assert 0 < small < large


def test_admission_queues_by_memory(profiled, tiny_sd3_dir, engine):
    """With room for 2.5 requests, at most 2 run at once; the rest wait and all finish with
    the same images as without a memory budget."""
    budgeted = _budget_engine(profiled, tiny_sd3_dir, 2.5)
    concurrency = []
    budgeted.add_step_listener(lambda rows, n, s: concurrency.append(budgeted.num_running))
    jobs = [(f"prompt {i}", SamplingParams(seed=i, num_inference_steps=3, output_type="np")) for i in range(5)]
    images, _ = _images(budgeted, jobs)
    assert max(concurrency) == 2
    want, _ = _images(engine, jobs)
    for got, ref in zip(images, want):
        assert np.abs(got - ref).max() <= 1e-4
    stats = budgeted.stats()["memory_budget"]
    assert set(stats) == {"max_memory", "weight_bytes", "reserve_bytes", "available", "in_use", "padding_bytes",
                          "method"}
    assert stats["in_use"] == 0


def test_memory_budget_counts_the_padding_of_mixed_sizes(profiled, tiny_sd3_dir, engine):
    """SD3 mixes sizes in one forward (rows padded to the widest). A 32x32 request beside a
    128x128 one: with room for both at their own sizes but not for the small one's rows padded
    to 128x128, they never share a forward (each step has one request's 2 rows) and both
    finish; with room for the padding too they share it (4 rows). Images equal solo runs."""
    budget, spec, limits = profiled.memory_budget, profiled.spec, profiled.config.limits
    jobs = [("a red fox", SamplingParams(seed=1, num_inference_steps=3, output_type="np", height=128, width=128)),
            ("a blue bird", SamplingParams(seed=2, num_inference_steps=3, output_type="np", height=32, width=32))]
    resolved = [p.resolve(spec, limits, 0) for _, p in jobs]
    f = spec.resolution_factor
    tokens = [2 * (p.height // f) * (p.width // f) for p in resolved]  # 2 rows each (CFG)
    slot = max(-(-budget.token_bytes(p, 2) // t) for p, t in zip(resolved, tokens))
    pad = slot * (2 * 2 * (128 // f) ** 2 - sum(tokens))
    own = sum(budget.request_bytes(p, 2) for p in resolved)
    assert pad > 0
    solo = [_images(engine, [job])[0][0] for job in jobs]
    for extra, shared in ((pad - 1, False), (pad, True)):
        limit = budget.profile.weight_bytes + budget.profile.reserve_bytes + own + extra
        budgeted = DiffusionEngine(EngineConfig(model=str(tiny_sd3_dir), max_memory=limit, overlap_stages=False),
                                   runner=profiled.runner)
        rows = []
        budgeted.add_step_listener(lambda n, k, s: rows.append(n))
        images, _ = _images(budgeted, jobs)
        assert (max(rows) == 4) is shared, rows
        for got, ref in zip(images, solo):
            assert np.abs(got - ref).max() <= 1e-4
        assert budgeted.stats()["memory_budget"]["in_use"] == 0


def test_oversized_request_is_refused_naming_the_limit(profiled, tiny_sd3_dir):
    budgeted = _budget_engine(profiled, tiny_sd3_dir, 1.5)
    with pytest.raises(InvalidRequestError, match="max_memory") as exc:
        budgeted.add_request("x", SamplingParams(num_images_per_prompt=2, output_type="np"))
    assert exc.value.field == "num_images_per_prompt" and "at most 1" in str(exc.value)
    with pytest.raises(InvalidRequestError, match="max_memory") as exc:
        budgeted.generate("x", SamplingParams(height=256, width=256, output_type="np"))
    assert exc.value.field == "size"
    assert not budgeted.has_unfinished_requests()
    [ok] = budgeted.generate("x", SamplingParams(seed=0, num_inference_steps=2, output_type="np"))
    assert ok.ok


def test_oversized_request_is_a_400_over_http(profiled, tiny_sd3_dir):
    budgeted = _budget_engine(profiled, tiny_sd3_dir, 1.5, num_threads=1)
    app = create_app(AsyncDiffusionEngine(engine=budgeted), "tiny")
    with TestClient(app) as client:
        resp = client.post("/v1/images/generations", json={"prompt": "x", "n": 1, "size": "256x256"})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "size" and "max_memory" in resp.json()["error"]["message"]


def test_max_memory_must_hold_the_weights(profiled, tiny_sd3_dir):
    with pytest.raises(InvalidRequestError, match="max_memory=1000"):
        DiffusionEngine(EngineConfig(model=str(tiny_sd3_dir), max_memory=1000), runner=profiled.runner)


@pytest.mark.parametrize("value, nbytes", [("24GiB", 24 * 2**30), ("512MB", 512 * 10**6), (4096, 4096),
                                           ("1.5KiB", 1536), ("auto", "auto"), (None, None)])
def test_parse_memory(value, nbytes):
    assert parse_memory(value) == nbytes


@pytest.mark.parametrize("value", ["lots", "-1GB", 0, True, "12XB", "1e400", "1e400GiB", float("inf"), float("nan")])
def test_bad_max_memory_names_the_field(value):
    with pytest.raises(InvalidRequestError, match="max_memory"):
        EngineConfig(max_memory=value)


def test_offload_config_is_validated():
    with pytest.raises(InvalidRequestError, match="offload_blocks"):
        EngineConfig(offload_blocks=2)
    with pytest.raises(InvalidRequestError, match="offload_blocks"):
        EngineConfig(layerwise_offload=True, offload_blocks=0)
    with pytest.raises(InvalidRequestError, match="cpu_offload"):
        EngineConfig(cpu_offload="yes")


def test_cli_memory_flags_reach_the_engine_config():
    args = build_parser().parse_args(["serve", "--cpu-offload", "--layerwise-offload", "--offload-blocks", "2",
                                      "--max-memory", "8GiB", "--enable-sleep-mode", "--wake-on-request"])
    config = engine_config_from_args(args)
    assert (config.cpu_offload, config.layerwise_offload, config.offload_blocks, config.max_memory,
            config.enable_sleep_mode, args.wake_on_request) == (True, True, 2, "8GiB", True, True)


# ------------------------------------------------------------------- per-request peak memory
def test_per_request_peak_memory_is_reported(engine):
    _, outs = _images(engine)
    for out in outs:
        m = out.metrics
        assert m.request_peak_memory_bytes is not None
        assert 0 <= m.request_peak_memory_bytes <= m.peak_memory_bytes
        assert m.as_dict()["request_peak_memory_bytes"] == m.request_peak_memory_bytes


def test_cpu_step_windows_read_the_high_water_mark_once_per_batch_composition(engine, monkeypatch):
    """Between two high-water-mark resets (here: none after the first), an unchanged batch's
    steps reuse the last read peak; a batch that changes composition is read again. Every step
    still reports a peak."""
    import diffserve.memory.accounting as memory
    import diffserve.runner.model_memory as model_memory

    if rss_bytes() is None:
        pytest.skip("no /proc on this platform")
    reads = []
    real = memory._proc_status
    monkeypatch.setattr(memory, "_proc_status", lambda *keys: reads.append(keys) or real(*keys))
    monkeypatch.setattr(model_memory, "STEP_RESET_INTERVAL_S", 3600.0)
    memory._reset_hwm()  # start the interval now
    steps = []
    listener = lambda rows, requests, seconds: steps.append(requests)  # noqa: E731
    engine.add_step_listener(listener)
    try:
        outs = engine.generate(["a red fox", "a blue bird"],
                               [SamplingParams(seed=1, num_inference_steps=8), SamplingParams(seed=2, num_inference_steps=3)])
    finally:
        engine._step_listeners.remove(listener)
    assert all(o.ok and o.metrics.request_peak_memory_bytes is not None for o in outs)
    assert steps == [2, 2, 2, 1, 1, 1, 1, 1]
    step_reads = [k for k in reads if k == ("VmHWM",)]
    assert len(step_reads) == 2  # the 2-request batch's first step, then the 1-request batch's


# ------------------------------------------------------------------------- composition
def test_compile_offload_and_cache_backend_compose(tmp_path_factory):
    """Regional compile + model and layerwise offload + TeaCache: three requests in a row with
    different seeds and a size change equal the engine without compile and offload."""
    from tiny_models import build_tiny_sd3

    one_block = build_tiny_sd3(tmp_path_factory.mktemp("tiny_sd3_compose"), num_layers=1)
    cache = {"cache_backend": "teacache", "cache_config": {"rel_l1_thresh": 0.3}}
    jobs = [("a red fox", SamplingParams(seed=1, num_inference_steps=8, output_type="np")),
            ("a blue bird", SamplingParams(seed=2, num_inference_steps=8, output_type="np")),
            ("a green tree", SamplingParams(seed=3, num_inference_steps=8, output_type="np", height=96, width=128))]
    plain = _engine(one_block, **cache)
    composed = _engine(one_block, compile=True, cpu_offload=True, max_batch_size=2, **cache)
    for prompt, params in jobs:
        [want] = plain.generate(prompt, params)
        [got] = composed.generate(prompt, params)
        assert got.ok, got.error
        assert np.abs(got.images - want.images).max() <= TOL
    stats = composed.stats()
    assert stats["acceleration"]["compile"]["enabled"] and stats["offload"]["mode"] == "model"
    assert stats["acceleration"]["cache_backend"]["skipped"] == plain.stats()["acceleration"]["cache_backend"]["skipped"] > 0


def test_whole_request_runner_refuses_offload_and_budget(tiny_sd15_dir, tmp_path):
    # a pipeline class without a step adapter (SD 1.5's own class has one): whole-request runner
    folder = shutil.copytree(tiny_sd15_dir, tmp_path / "img2img")
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps({**index, "_class_name": "StableDiffusionImg2ImgPipeline"}))
    with pytest.raises(InvalidRequestError, match="cpu_offload"):
        _engine(folder, cpu_offload=True)

