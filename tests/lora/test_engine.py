"""LoRA adapters through the offline API: loading, listing, unloading, per-request validation,
adapters loaded on first use from ``lora_dir`` while other requests keep stepping, load
failures, the device-slot limit, the host-memory LRU, and the whole-request fallback."""

from __future__ import annotations

import json
import math
import threading

import numpy as np
import pytest
import torch
from diffusers import StableDiffusion3Img2ImgPipeline, StableDiffusion3Pipeline
from PIL import Image
from tiny_models.loras import diffusers_reference, random_lora, save_diffusers_lora

from diffserve import DiffusionEngine, EngineConfig, InvalidRequestError, SamplingParams
from diffserve.core.errors import LoraInUseError

ATTN = ("to_q", "to_k", "to_v", "to_out.0")
P = dict(num_inference_steps=2, height=64, width=64, output_type="np")


@pytest.fixture(scope="module")
def lora_files(tiny_sd3_dir, tmp_path_factory):
    """Three adapter folders (a, b, c) for the tiny SD3 folder, in a lora_dir."""
    root = tmp_path_factory.mktemp("lora_dir")
    pipe = StableDiffusion3Pipeline.from_pretrained(tiny_sd3_dir, text_encoder_3=None, tokenizer_3=None)
    files = {}
    for i, name in enumerate("abc"):
        sd = random_lora(pipe.transformer, ATTN, 2, seed=20 + i)
        files[name] = save_diffusers_lora(StableDiffusion3Pipeline, root / name, {"transformer": (sd, 2, 2.0)})
    return root, files


def _finish(engine) -> dict:
    outs = {}
    while engine.has_unfinished_requests():
        for event in engine.step():
            if event.type.is_final:
                outs[event.request_id] = event.output
    return outs


def test_load_list_unload_and_bad_requests(tiny_sd3_dir, lora_files):
    root, files = lora_files
    engine = DiffusionEngine(EngineConfig(model=str(tiny_sd3_dir), max_loras=2, overlap_stages=False))
    info = engine.load_lora("a", files["a"])
    assert info["state"] == "ready" and info["rank"] == 2 and info["modules"] == {"transformer": 8}
    assert [e["name"] for e in engine.list_loras()] == ["a"]
    bad = [({"nope": 1.0}, "unknown LoRA 'nope'"), ({"a": 4.5}, r"\[-4, 4\]"), ({"a": math.nan}, "finite"),
           ({"a": math.inf}, "finite"), ({"a": "1"}, "scale"), ({"": 1.0}, "name"), ({"a": True}, "scale"),
           ("a", "mapping")]
    for loras, message in bad:
        with pytest.raises(InvalidRequestError, match=message) as info:
            engine.add_request("a cat", SamplingParams(loras=loras, **P))
        assert info.value.field == "loras"
    engine.load_lora("b", files["b"])
    engine.load_lora("c", files["c"])
    with pytest.raises(InvalidRequestError, match="at most 2 LoRA") as info:  # max_loras adapters per request
        engine.add_request("a cat", SamplingParams(loras={"a": 1, "b": 1, "c": 1}, **P))
    assert info.value.field == "loras"
    with pytest.raises(InvalidRequestError) as info:
        engine.load_lora("d", root / "missing.safetensors")
    assert info.value.field == "path"
    with pytest.raises(InvalidRequestError) as info:
        engine.load_lora("bad/name", files["a"])
    assert info.value.field == "name"

    request_id = engine.add_request("a cat", SamplingParams(loras={"a": 1.0}, **P))
    with pytest.raises(LoraInUseError, match="waiting or running"):
        engine.unload_lora("a")
    with pytest.raises(LoraInUseError):
        engine.load_lora("a", files["b"])  # replacing an adapter in use
    assert {e["name"]: e["in_use"] for e in engine.list_loras()}["a"] == 1
    outs = _finish(engine)
    assert outs[request_id].ok
    engine.unload_lora("a")
    assert "a" not in [e["name"] for e in engine.list_loras()]
    with pytest.raises(InvalidRequestError) as info:
        engine.unload_lora("a")
    assert info.value.field == "name"
    engine.shutdown()


def test_lora_dir_adapter_loads_beside_the_steps(tiny_sd3_dir, lora_files, monkeypatch):
    """A request naming an adapter of lora_dir waits in the queue while it loads; a running
    request keeps stepping meanwhile; a failed load fails only the requests waiting for it."""
    root, files = lora_files
    engine = DiffusionEngine(EngineConfig(model=str(tiny_sd3_dir), lora_dir=str(root)))
    runner = engine.runner
    release = threading.Event()
    original = runner.load_lora

    def slow_load(name, path):
        assert release.wait(60)
        return original(name, path)

    monkeypatch.setattr(runner, "load_lora", slow_load)
    plain = engine.add_request("a cat", SamplingParams(seed=1, **{**P, "num_inference_steps": 6}))
    with_lora = engine.add_request("a cat", SamplingParams(seed=2, loras={"b": 1.0}, **P))
    assert {e["name"]: e["state"] for e in engine.list_loras()}["b"] == "loading"
    outs = {}
    while plain not in outs:
        for event in engine.step():
            if event.type.is_final:
                outs[event.request_id] = event.output
    assert outs[plain].ok and with_lora not in outs  # the plain request finished; the LoRA one still waits
    assert engine.queue_position(with_lora) == 1
    release.set()
    outs.update(_finish(engine))
    assert outs[with_lora].ok
    assert outs[with_lora].metrics.batch_sizes == {2: 2}

    (root / "broken.safetensors").write_bytes(b"not a safetensors file")
    failing = engine.add_request("a cat", SamplingParams(loras={"broken": 1.0}, **P))
    fine = engine.add_request("a cat", SamplingParams(loras={"b": 0.5}, **P))
    outs = _finish(engine)
    assert not outs[failing].ok and "loras" in outs[failing].error and "broken" in outs[failing].error
    assert outs[fine].ok
    engine.shutdown()


def test_slots_limit_and_host_lru(tiny_sd3_dir, lora_files):
    """max_loras=1: requests with different adapters never share a step (they take turns);
    max_cpu_loras=2: a third adapter drops the least recently used one from host memory, and
    naming it again reloads it."""
    root, files = lora_files
    engine = DiffusionEngine(EngineConfig(model=str(tiny_sd3_dir), lora_dir=str(root), max_loras=1,
                                          max_cpu_loras=2, overlap_stages=False))
    ids = [engine.add_request("a cat", SamplingParams(seed=i, loras={name: 1.0}, **P))
           for i, name in enumerate(["a", "b", "a", "c"])]
    outs = _finish(engine)
    assert all(outs[i].ok for i in ids)
    assert all(max(outs[i].metrics.batch_sizes) <= 4 for i in ids)  # a's two requests may share; never a with b
    states = {e["name"]: e["state"] for e in engine.list_loras()}
    assert sorted(states.values()).count("ready") == 2 and states["c"] == "ready"
    evicted = next(n for n, s in states.items() if s == "registered")
    [again] = engine.generate("a cat", SamplingParams(seed=9, loras={evicted: 1.0}, **P))
    assert again.ok
    engine.shutdown()


def test_whole_request_fallback_uses_diffusers_set_adapters(tiny_sd3_dir, lora_files, tmp_path):
    """A pipeline class without a step adapter (SD3 img2img, served whole-request) takes LoRA
    per request through diffusers' own load_lora_weights + set_adapters."""
    import shutil

    root, files = lora_files
    folder = tmp_path / "img2img"
    shutil.copytree(tiny_sd3_dir, folder)
    index = json.loads((folder / "model_index.json").read_text())
    index["_class_name"] = "StableDiffusion3Img2ImgPipeline"
    (folder / "model_index.json").write_text(json.dumps(index))
    engine = DiffusionEngine(EngineConfig(model=str(folder), loras={"a": str(files["a"])}))
    assert engine.model_info.step_batching is False
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8))
    params = [SamplingParams(seed=3, strength=0.8, loras={"a": 0.8}, **{**P, "num_inference_steps": 4}),
              SamplingParams(seed=3, strength=0.8, **{**P, "num_inference_steps": 4})]
    outs = engine.generate(["a cat", "a cat"], params, inputs=image)
    pipe = StableDiffusion3Img2ImgPipeline.from_pretrained(folder, text_encoder_3=None, tokenizer_3=None)
    pipe.set_progress_bar_config(disable=True)
    for out, loras in zip(outs, [{"a": 0.8}, {}]):
        diffusers_reference(pipe, {"a": files["a"]}, loras)
        ref = pipe("a cat", image=image, strength=0.8, num_inference_steps=4, height=64, width=64,
                   generator=torch.Generator().manual_seed(3), output_type="np").images
        assert np.abs(np.asarray(out.images) - ref).max() <= 1 / 255, loras
    assert np.abs(np.asarray(outs[0].images) - np.asarray(outs[1].images)).max() > 0
    engine.shutdown()


def test_events_and_metadata_name_the_adapters(tiny_sd3_dir, lora_files):
    root, files = lora_files
    engine = DiffusionEngine(EngineConfig(model=str(tiny_sd3_dir), loras={"a": str(files["a"])},
                                          overlap_stages=False))
    [out] = engine.generate("a cat", SamplingParams(seed=1, loras={"a": 0.5}, **P))
    assert out.params.loras == {"a": 0.5}
    from diffserve.media.metadata import image_metadata

    meta = image_metadata("a cat", out.params, out.seed, "tiny")
    assert "<lora:a:0.5>" in meta["parameters"] and json.loads(meta["diffserve"])["loras"] == {"a": 0.5}
    engine.shutdown()



def test_compiled_engine_switches_adapters_without_recompiling(tiny_sd3_dir, lora_files, monkeypatch):
    """--compile with adapters configured: every layer is hooked before the warm-up, which also
    runs with LoRA rows; afterwards new adapters, mixes and scales cause no recompile
    (dynamo's counters; the 'eager' backend keeps the test fast: guards and recompiles are
    dynamo's, whatever the backend)."""
    from diffserve.acceleration import compile as compile_module

    root, files = lora_files
    monkeypatch.setattr(compile_module, "COMPILE_BACKEND", "eager")
    engine = DiffusionEngine(EngineConfig(model=str(tiny_sd3_dir), compile=True, max_batch_size=4, lora_dir=str(root),
                                          loras={"a": str(files["a"])}, overlap_stages=False))
    assert engine.stats()["acceleration"]["compile"]["enabled"]
    unguided = {**P, "guidance_scale": 1.0}
    for loras in ({"a": 1.0}, None, {"b": 0.5}, {"a": 0.3, "c": -1.0}):
        engine.generate(["a cat", "a dog"], [SamplingParams(seed=1, loras=loras, **unguided),
                                             SamplingParams(seed=2, **unguided)])
    assert engine.stats()["acceleration"]["compile"]["recompiles_after_warmup"] == 0
    engine.shutdown()


def test_teacache_rows_that_compute_keep_their_adapters(tiny_sd3_dir, lora_files, monkeypatch):
    """TeaCache runs the blocks on the rows of the requests that compute: a LoRA request that
    computes while its batch-mate reuses its residual gets its own adapter's deltas (equal to
    its run alone)."""
    root, files = lora_files
    engine = DiffusionEngine(EngineConfig(model=str(tiny_sd3_dir), cache_backend="teacache",
                                          cache_config={"rel_l1_thresh": 100.0}, loras={"a": str(files["a"])},
                                          overlap_stages=False))
    short = SamplingParams(seed=1, loras={"a": 1.0}, **{**P, "num_inference_steps": 4})
    long = SamplingParams(seed=2, **{**P, "num_inference_steps": 8})
    from diffserve.acceleration import teacache

    subsets = []
    narrowed_rows = teacache.narrowed_rows
    monkeypatch.setattr(teacache, "narrowed_rows", lambda index: subsets.append(list(index)) or narrowed_rows(index))
    together = engine.generate(["a cat", "a dog"], [short, long])
    monkeypatch.setattr(teacache, "narrowed_rows", narrowed_rows)
    assert subsets and all(len(rows) == 2 for rows in subsets)  # one request's two CFG rows computed alone
    alone = [engine.generate("a cat", short)[0], engine.generate("a dog", long)[0]]
    for t, a in zip(together, alone):
        assert np.abs(np.asarray(t.images) - np.asarray(a.images)).max() <= 1e-4
    assert engine.stats()["acceleration"]["cache_backend"]["transformer_calls"] > 0
    engine.shutdown()
