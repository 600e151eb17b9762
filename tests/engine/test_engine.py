"""The engine on a tiny model: abort, error isolation, queue bound, execution modes, and the
async engine's streaming and cancellation (the request scheduler alone, without a model:
test_scheduler.py; its queue policy: test_queues.py)."""

from __future__ import annotations

import asyncio
import gc
import weakref

import numpy as np
import pytest

from diffserve import (
    AsyncDiffusionEngine,
    DiffusionEngine,
    EngineConfig,
    EngineOverloadedError,
    EventType,
    RequestStatus,
    SamplingParams,
)

TOL = 1e-4


def _p(seed, steps=3, guidance=4.0, **kw):
    return SamplingParams(seed=seed, num_inference_steps=steps, guidance_scale=guidance, output_type="np", **kw)


def _run(engine):
    finals = {}
    while engine.has_unfinished_requests():
        for e in engine.step():
            if e.type.is_final:
                finals[e.request_id] = e
    return finals


# ------------------------------------------------------------------ batch size
def test_big_request_runs_alone_when_it_exceeds_the_batch(engine):
    [out] = engine.generate("x", _p(1, steps=2, num_images_per_prompt=10))  # 20 rows > 16
    assert out.ok and out.metrics.batch_sizes == {20: 2}


# ------------------------------------------------------------------------- abort
def test_abort_waiting_and_running(engine):
    reference = engine.generate("after", _p(5))[0].images
    running = engine.add_request("long", _p(1, steps=50))
    engine.step()
    engine.step()
    waiting_eng = engine  # same engine, a second request that is still waiting
    engine.scheduler.queues.max_batch_size = 2  # so the next one cannot be admitted
    try:
        waiting = waiting_eng.add_request("queued", _p(2))
        engine.step()
        assert engine.queue_position(waiting) == 1
        assert engine.abort(waiting) and engine.abort(running)
        finals = _run(engine)
    finally:
        engine.scheduler.queues.max_batch_size = 16
    assert finals[waiting].type is EventType.ABORTED and finals[running].type is EventType.ABORTED
    assert finals[running].output.status is RequestStatus.ABORTED
    assert finals[running].output.metrics.num_steps < 50
    assert engine.num_running == 0 and engine.num_waiting == 0
    assert not engine.abort(running)  # already done
    after = engine.generate("after", _p(5))[0]
    assert np.abs(after.images - reference).max() <= TOL


# -------------------------------------------------------------------- isolation
@pytest.mark.parametrize("stage", ["prepare", "step", "decode"])
def test_failure_is_isolated_to_its_request(engine, monkeypatch, stage):
    adapter = engine.runner.adapter
    original = getattr(adapter, stage)
    seen = []

    def flaky(state_or_batch, *args):
        states = getattr(state_or_batch, "states", [state_or_batch])  # step() takes the batch
        for state in states:
            if "FAIL" in state.prompt:
                seen.append(weakref.ref(state))
                raise RuntimeError(f"injected {stage} failure")
        return original(state_or_batch, *args)

    monkeypatch.setattr(adapter, stage, flaky)
    if stage == "decode":  # route the batched decode through the per-request one being tested
        from diffserve.pipelines.base import PipelineAdapter

        monkeypatch.setattr(adapter, "decode_many", lambda states, latents: PipelineAdapter.decode_many(
            adapter, states, latents))
    solo = [engine.generate(p, _p(s))[0].images for p, s in (("ok one", 1), ("ok two", 2))]
    for _ in range(3):  # repeated failures leave nothing behind
        outs = engine.generate(["ok one", "FAIL me", "ok two"], [_p(1), _p(3), _p(2)])
        assert [o.status for o in outs] == [RequestStatus.FINISHED, RequestStatus.FAILED, RequestStatus.FINISHED]
        assert f"injected {stage} failure" in outs[1].error
        assert np.abs(outs[0].images - solo[0]).max() <= TOL
        assert np.abs(outs[2].images - solo[1]).max() <= TOL
    gc.collect()
    assert seen and all(ref() is None or ref().latents is None for ref in seen)
    assert not engine.has_unfinished_requests() and engine.num_running == 0


def test_batched_decode_failure_decodes_requests_alone(engine, monkeypatch):
    adapter = engine.runner.adapter
    original = adapter._vae_decode
    calls = []

    def fragile(latents):
        calls.append(latents.shape[0])
        if latents.shape[0] > 1:
            raise RuntimeError("injected batched VAE failure")
        return original(latents)

    solo = [engine.generate(p, _p(s))[0].images for p, s in (("one", 1), ("two", 2))]
    monkeypatch.setattr(adapter, "_vae_decode", fragile)
    outs = engine.generate(["one", "two"], [_p(1), _p(2)])
    assert all(o.ok for o in outs) and 2 in calls and calls.count(1) >= 2
    for out, ref in zip(outs, solo):
        assert np.abs(out.images - ref).max() <= TOL


def test_batched_forward_failure_retries_requests_alone(engine, monkeypatch):
    adapter = engine.runner.adapter
    original = adapter.denoise

    def denoise(batch, call=None):
        if any("FAIL" in s.prompt for s in batch.states):
            raise RuntimeError("injected forward failure")
        return original(batch, call)

    monkeypatch.setattr(adapter, "denoise", denoise)
    solo = engine.generate("fine", _p(4))[0].images
    outs = engine.generate(["fine", "FAIL"], [_p(4), _p(6)])
    assert outs[0].ok and not outs[1].ok
    assert np.abs(outs[0].images - solo).max() <= TOL


# ------------------------------------------------------------------ execution modes
def test_request_mode_runs_static_batches(tiny_sd3_dir, engine):
    static = DiffusionEngine(EngineConfig(model=str(tiny_sd3_dir), execution_mode="request"),
                             runner=engine.runner)
    first = static.add_request("a", _p(1, steps=4))
    static.step()
    late = static.add_request("b", _p(2, steps=2))
    finals = _run(static)
    # the late request waited for the static batch to finish instead of joining it
    assert finals[late].output.metrics.batch_sizes == {2: 2}
    assert finals[first].output.metrics.batch_sizes == {2: 4}
    step_mode = engine.generate(["a", "b"], [_p(1, steps=4), _p(2, steps=2)])
    assert np.abs(finals[first].output.images - step_mode[0].images).max() <= TOL
    assert np.abs(finals[late].output.images - step_mode[1].images).max() <= TOL


def test_waiting_queue_bound(tiny_sd3_dir, engine):
    small = DiffusionEngine(EngineConfig(model=str(tiny_sd3_dir), max_waiting_requests=2), runner=engine.runner)
    small.add_request("a", _p(1))
    small.add_request("b", _p(2))
    with pytest.raises(EngineOverloadedError):
        small.add_request("c", _p(3))
    _run(small)


def test_aborting_a_waiting_request_frees_its_queue_slot_at_once(tiny_sd3_dir, engine):
    small = DiffusionEngine(EngineConfig(model=str(tiny_sd3_dir), max_waiting_requests=1), runner=engine.runner)
    first = small.add_request("a", _p(1))
    assert small.abort(first)
    second = small.add_request("b", _p(2))  # no step in between
    finals = _run(small)
    assert finals[first].type is EventType.ABORTED and finals[second].type is EventType.FINISHED


def test_unique_ids_for_identical_requests(engine):
    ids = {engine.add_request("same", _p(1, steps=1)) for _ in range(5)}
    assert len(ids) == 5
    _run(engine)


# --------------------------------------------------------------------- async engine
def test_async_streams_events_in_order(engine):
    async def main():
        async_engine = AsyncDiffusionEngine(engine=engine)
        try:
            events = [e async for e in async_engine.generate("stream me", _p(8, steps=3), preview_steps=[2])]
        finally:
            async_engine.shutdown(timeout_s=5)
        return events

    events = asyncio.run(main())
    kinds = [e.type for e in events]
    # the preview is decoded beside the next steps: it follows step 2 and precedes the final
    # event, but may come after step 3's progress
    assert kinds[:4] == [EventType.QUEUED, EventType.STARTED, EventType.PROGRESS, EventType.PROGRESS]
    assert kinds[-1] is EventType.FINISHED and kinds.count(EventType.PARTIAL) == 1 and len(kinds) == 7
    assert [e.step for e in events if e.type is EventType.PROGRESS] == [1, 2, 3]
    [partial] = [e for e in events if e.type is EventType.PARTIAL]
    assert partial.step == 2 and partial.preview.shape == (1, 64, 64, 3)
    solo = engine.generate("stream me", _p(8, steps=3))[0].images
    assert np.abs(events[-1].output.images - solo).max() <= TOL


def test_async_concurrent_requests_batch_and_cancel(engine):
    async def consume(async_engine, prompt, params):
        return [e async for e in async_engine.generate(prompt, params)]

    async def main():
        async_engine = AsyncDiffusionEngine(engine=engine)
        try:
            victim = asyncio.create_task(consume(async_engine, "cancel me", _p(1, steps=200)))
            others = [asyncio.create_task(consume(async_engine, f"p{i}", _p(i, steps=3))) for i in range(4)]
            results = await asyncio.gather(*others)
            victim.cancel()
            with pytest.raises(asyncio.CancelledError):
                await victim
            for _ in range(200):  # the aborted request frees its slot at the next step
                if not engine.has_unfinished_requests():
                    break
                await asyncio.sleep(0.01)
            return results
        finally:
            async_engine.shutdown(timeout_s=5)

    results = asyncio.run(main())
    assert not engine.has_unfinished_requests()
    for events in results:
        assert events[-1].type is EventType.FINISHED
    assert max(max(ev[-1].output.metrics.batch_sizes) for ev in results) > 2  # batched together
    assert len({ev[-1].request_id for ev in results}) == 4
