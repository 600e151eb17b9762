"""Scale-out inside one engine: the multi-process executor, CFG parallelism and Ulysses sequence
parallelism over torch.distributed (gloo, CPU), worker death."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from diffserve import (
    DiffusionEngine,
    EngineConfig,
    EngineDeadError,
    InvalidRequestError,
    RequestStatus,
    SamplingParams,
)

TOL = 1e-5
PROMPTS = ["a cat", "a dog", "a boat"]


def _params():
    # mixed CFG on/off, seeds, step counts: two batch keys, batching inside each
    return [SamplingParams(seed=1, num_inference_steps=3, guidance_scale=4.0, output_type="np"),
            SamplingParams(seed=2, num_inference_steps=2, guidance_scale=1.0, output_type="np"),
            SamplingParams(seed=3, num_inference_steps=4, guidance_scale=6.0, num_images_per_prompt=2,
                           output_type="np")]


@pytest.fixture(scope="module")
def reference(tiny_sd3_dir):
    """Single-process outputs without context folding (parallel SD3 runs unfolded)."""
    engine = DiffusionEngine(EngineConfig(model=str(tiny_sd3_dir), context_folding=False))
    return engine.generate(PROMPTS, _params())


@pytest.mark.parametrize("layout", [{"cfg_parallel_size": 2}, {"cfg_parallel_size": 2, "ulysses_degree": 2}],
                         ids=["cfg2", "cfg2-ulysses2"])
def test_parallel_engine_equals_single_process(tiny_sd3_dir, reference, layout):
    engine = DiffusionEngine(EngineConfig(model=str(tiny_sd3_dir), num_threads=1, **layout))
    try:
        outs = engine.generate(PROMPTS, _params())
        stats = engine.stats()
    finally:
        engine.shutdown()
    assert stats["world_size"] == layout.get("cfg_parallel_size", 1) * layout.get("ulysses_degree", 1)
    for out, ref in zip(outs, reference):
        assert out.ok, out.error
        assert np.abs(out.images - ref.images).max() <= TOL
    assert max(outs[0].metrics.batch_sizes) >= 2  # still step-batched across requests


def test_ulysses_alone_equals_single_process(tiny_sd3_dir, reference):
    engine = DiffusionEngine(EngineConfig(model=str(tiny_sd3_dir), num_threads=1, ulysses_degree=2))
    try:
        outs = engine.generate(PROMPTS, _params())
    finally:
        engine.shutdown()
    for out, ref in zip(outs, reference):
        assert np.abs(out.images - ref.images).max() <= TOL


def test_worker_death_fails_requests_and_is_reported(tiny_sd3_dir):
    engine = DiffusionEngine(EngineConfig(model=str(tiny_sd3_dir), executor="multiprocess", num_threads=1,
                                          overlap_stages=False))
    executor = engine.executor
    try:
        [ok] = engine.generate("before", SamplingParams(seed=1, num_inference_steps=2, output_type="np"))
        assert ok.ok and executor.stats()["workers_alive"] == 1
        request_id = engine.add_request("doomed", SamplingParams(seed=2, num_inference_steps=200))
        engine.step()
        os.kill(executor._procs[0].pid, signal.SIGKILL)
        start = time.perf_counter()
        finals = {}
        while engine.has_unfinished_requests() and time.perf_counter() - start < 30:
            try:
                events = engine.step()
            except EngineDeadError:
                events = engine.fail_unfinished("worker died")
            finals.update({e.request_id: e for e in events if e.type.is_final})
        assert finals[request_id].output.status is RequestStatus.FAILED
        assert time.perf_counter() - start < 30  # failed fast, no hang
        stats = executor.stats()
        assert stats["workers_alive"] == 0 and "exited with code" in stats["dead"]
        with pytest.raises(EngineDeadError, match="worker 0"):
            engine.add_request("after", SamplingParams(seed=3))
    finally:
        engine.shutdown()


def test_parallel_refuses_cache_backends_and_fallback_classes(tiny_sd3_dir):
    with pytest.raises(InvalidRequestError) as info:
        EngineConfig(model=str(tiny_sd3_dir), cfg_parallel_size=2, executor="inprocess")
    assert info.value.field == "executor"
    with pytest.raises(InvalidRequestError) as info:
        EngineConfig(model=str(tiny_sd3_dir), ulysses_degree=0)
    assert info.value.field == "ulysses_degree"


def test_flux_mixed_sizes_under_cfg_parallel_and_ulysses(tiny_flux_dev_dir):
    """Flux rows of different sizes: CFG parallel splits them by branch and keeps one mixed
    forward (each rank's per-row positions follow its rows); Ulysses batches them by size again
    (`FluxAdapter._context_parallel`). Both equal the single-process engine."""
    prompts = ["a red kite", "a boat"]
    params = [SamplingParams(seed=1, num_inference_steps=2, height=64, width=48, true_cfg_scale=2.0,
                             negative_prompt="x", max_sequence_length=32, output_type="np"),
              SamplingParams(seed=2, num_inference_steps=3, height=32, width=64, true_cfg_scale=3.0,
                             negative_prompt="", max_sequence_length=32, output_type="np")]
    reference = DiffusionEngine(EngineConfig(model=str(tiny_flux_dev_dir), num_threads=1)).generate(prompts, params)
    for layout, mixed in (({"cfg_parallel_size": 2}, True), ({"ulysses_degree": 2}, False)):
        engine = DiffusionEngine(EngineConfig(model=str(tiny_flux_dev_dir), num_threads=1, **layout))
        try:
            keys = [engine.executor.plan(p).batch_key for p in params]
            outs = engine.generate(prompts, params)
        finally:
            engine.shutdown()
        assert (keys[0] == keys[1]) is mixed, (layout, keys)
        if mixed:
            assert [max(o.metrics.batch_sizes) for o in outs] == [4, 4]
        for out, ref in zip(outs, reference):
            assert out.ok, out.error
            assert np.abs(out.images - ref.images).max() <= 1e-4


def test_wan_mixed_sizes_under_cfg_parallel_and_ulysses(tiny_wan_dir):
    """Wan rows of different sizes and frame counts: CFG parallel keeps one mixed forward (each
    rank's key mask follows its rows); Ulysses batches them by size and frames again
    (`PipelineAdapter.mixed_sizes` off). Both equal the single-process engine."""
    prompts = ["a red kite", "a boat"]
    params = [SamplingParams(seed=1, num_inference_steps=2, height=32, width=48, num_frames=5, guidance_scale=4.0,
                             output_type="latent"),
              SamplingParams(seed=2, num_inference_steps=3, height=48, width=32, num_frames=9, guidance_scale=3.0,
                             negative_prompt="x", output_type="latent")]
    reference = DiffusionEngine(EngineConfig(model=str(tiny_wan_dir), num_threads=1)).generate(prompts, params)
    for layout, mixed in (({"cfg_parallel_size": 2}, True), ({"ulysses_degree": 2}, False)):
        engine = DiffusionEngine(EngineConfig(model=str(tiny_wan_dir), num_threads=1, **layout))
        try:
            keys = [engine.executor.plan(p).batch_key for p in params]
            outs = engine.generate(prompts, params)
        finally:
            engine.shutdown()
        assert (keys[0] == keys[1]) is mixed, (layout, keys)
        if mixed:
            assert [max(o.metrics.batch_sizes) for o in outs] == [4, 4]
        for out, ref in zip(outs, reference):
            assert out.ok, out.error
            assert (out.videos[0] - ref.videos[0]).abs().max() <= 1e-4


def test_kontext_mixed_references_under_cfg_parallel_and_ulysses(tiny_flux_kontext_dir):
    """Kontext edits whose references (and outputs) differ in size: CFG parallel keeps them in
    one forward (each rank's per-row reference tables and masks follow its rows); Ulysses
    batches them apart (the reference size is in its batch key). Both equal the single-process
    engine."""
    from PIL import Image

    prompts = ["make it red", "add a hat"]
    images = [Image.fromarray(np.random.default_rng(k).integers(0, 256, (h, w, 3), dtype=np.uint8))
              for k, (w, h) in enumerate(((32, 32), (64, 48)))]
    params = [SamplingParams(seed=1, num_inference_steps=2, height=48, width=64, true_cfg_scale=2.0,
                             negative_prompt="x", max_sequence_length=32, output_type="np"),
              SamplingParams(seed=2, num_inference_steps=3, height=32, width=64, true_cfg_scale=3.0,
                             negative_prompt="", max_sequence_length=32, output_type="np")]
    reference = DiffusionEngine(EngineConfig(model=str(tiny_flux_kontext_dir), num_threads=1)).generate(
        prompts, params, inputs=images)
    for layout, rows in (({"cfg_parallel_size": 2}, [4, 4]), ({"ulysses_degree": 2}, [2, 2])):
        engine = DiffusionEngine(EngineConfig(model=str(tiny_flux_kontext_dir), num_threads=1, **layout))
        try:
            outs = engine.generate(prompts, params, inputs=images)
        finally:
            engine.shutdown()
        assert [max(o.metrics.batch_sizes) for o in outs] == rows, layout
        for out, ref in zip(outs, reference):
            assert out.ok, out.error
            assert np.abs(out.images - ref.images).max() <= 1e-4


@pytest.mark.parametrize("folder", ["tiny_flux_kontext_dir", "tiny_flux_dev_dir"])
def test_ulysses_odd_token_count_equals_single_process(folder, request):
    """An odd image-token count (48x48 output: 9 tokens; Kontext with a 32x32 reference: 9 + 4)
    leaves the two Ulysses ranks shards of 5 and 4 (7 and 6) tokens; the output gather pads them
    to one length for gloo (`diffserve.parallel.uneven_gather`) and equals the single process."""
    from PIL import Image

    model = str(request.getfixturevalue(folder))
    kontext = folder == "tiny_flux_kontext_dir"
    inputs = [Image.fromarray(np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8))] \
        if kontext else None
    params = [SamplingParams(seed=1, num_inference_steps=2, height=48, width=48, max_sequence_length=32,
                             output_type="np")]
    [ref] = DiffusionEngine(EngineConfig(model=model, num_threads=1)).generate(["a cat"], params, inputs=inputs)
    engine = DiffusionEngine(EngineConfig(model=model, num_threads=1, ulysses_degree=2))
    try:
        [out] = engine.generate(["a cat"], params, inputs=inputs)
    finally:
        engine.shutdown()
    assert out.ok, out.error
    assert np.abs(out.images - ref.images).max() <= 1e-4
