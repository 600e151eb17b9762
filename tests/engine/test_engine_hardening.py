"""Engine hardening (issue 15): concurrent offline callers, non-finite outputs, a dying engine
loop, long prompts, the prompt cache's byte bound and the loader's one-line errors."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest
import torch

from diffserve import (
    AsyncDiffusionEngine,
    DiffusionEngine,
    EngineConfig,
    EngineDeadError,
    RequestStatus,
    EventType,
    SamplingParams,
    UnsupportedModelError,
)

TOL = 1e-4


def _p(seed, steps=3, **kw):
    return SamplingParams(seed=seed, num_inference_steps=steps, guidance_scale=4.0, output_type="np", **kw)


# ------------------------------------------------------------------ thread safety
def test_generate_from_several_threads_gets_each_its_solo_result(engine):
    jobs = [(f"thread {i} prompt", _p(40 + i, steps=2 + i)) for i in range(3)]
    solo = [engine.generate(prompt, params)[0].images for prompt, params in jobs]
    results: dict[int, list] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(jobs))

    def worker(i):
        try:
            barrier.wait()
            for _ in range(3):  # repeated, so calls overlap in every phase
                results.setdefault(i, []).append(engine.generate(*jobs[i])[0])
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a generate call hung"
    assert not errors, errors
    for i, outs in results.items():
        assert len(outs) == 3
        for out in outs:
            assert out.ok and out.prompt == jobs[i][0]
            assert np.abs(out.images - solo[i]).max() <= TOL
    shared = [b for outs in results.values() for o in outs for b in o.metrics.batch_sizes]
    assert max(shared) > 2  # calls from different threads really shared forwards


def test_generate_beside_a_running_async_engine(engine):
    """An offline generate call on an engine whose async loop is stepping other requests gets
    its own events (whichever thread steps), and the async consumer gets its own."""
    solo_sync = engine.generate("sync side", _p(1, steps=4))[0].images
    solo_async = engine.generate("async side", _p(2, steps=6))[0].images

    async def main():
        async_engine = AsyncDiffusionEngine(engine=engine)
        try:
            sync_result = asyncio.get_running_loop().run_in_executor(
                None, lambda: engine.generate("sync side", _p(1, steps=4))[0])
            events = [e async for e in async_engine.generate("async side", _p(2, steps=6))]
            return await sync_result, events[-1].output
        finally:
            async_engine.shutdown(timeout_s=5)

    sync_out, async_out = asyncio.run(main())
    assert sync_out.ok and async_out.ok
    assert np.abs(sync_out.images - solo_sync).max() <= TOL
    assert np.abs(async_out.images - solo_async).max() <= TOL


def test_progress_events_are_opt_in_per_request(engine):
    """A consumer that only waits for the result asks for no per-step progress events (the
    HTTP server's non-streaming requests): the async engine then hands it queued, started and
    finished only, while a request beside it still gets one per step."""
    async def run():
        front = AsyncDiffusionEngine(engine=engine)

        async def events(rid, progress):
            return [e async for e in front.generate("a cat", _p(1), request_id=rid, progress=progress)]

        try:
            return await asyncio.gather(events("quiet", False), events("chatty", True))
        finally:
            await asyncio.get_running_loop().run_in_executor(None, front.shutdown)

    quiet, chatty = asyncio.run(run())
    assert [e.type for e in quiet] == [EventType.QUEUED, EventType.STARTED, EventType.FINISHED]
    assert [e.step for e in chatty if e.type is EventType.PROGRESS] == [1, 2, 3]
    assert quiet[-1].output.metrics.num_steps == 3 == chatty[-1].output.metrics.num_steps


# --------------------------------------------------------------- non-finite outputs
def test_abort_while_preparing_wins_over_a_failing_prepare(tiny_sd3_dir, monkeypatch):
    """abort() said True for a request being prepared: when its prepare then fails, it still
    ends aborted (as when its decode or chunk work comes back)."""
    engine = DiffusionEngine(EngineConfig(model=str(tiny_sd3_dir)))  # prepare on the side thread
    started = threading.Event()

    def failing_prepare(state):
        started.set()
        time.sleep(0.2)
        raise RuntimeError("prepare failed")

    monkeypatch.setattr(engine.runner.adapter, "prepare", failing_prepare)
    rid = engine.add_request("a cat", _p(1))
    engine.step()
    assert started.wait(5) and engine.abort(rid)
    finals = []
    while engine.has_unfinished_requests():
        finals += [e for e in engine.step() if e.type.is_final]
    assert [e.output.status for e in finals] == [RequestStatus.ABORTED]


def test_a_failed_shared_step_is_retried_alone_and_books_each_requests_own_forward(sync_engine, monkeypatch):
    """A shared step that raises after its forward is retried request by request: the healthy
    requests end as their solo runs, each booking the rows of its own retry forward."""
    adapter = sync_engine.runner.adapter
    step = adapter.step

    def failing_step(batch, guided):  # "bad" fails its second step, shared or alone
        if any(s.prompt == "bad" and s.step_index == 1 for s in batch.states):
            raise RuntimeError("injected")
        return step(batch, guided)

    monkeypatch.setattr(adapter, "step", failing_step)
    jobs = [("a red car", _p(1)), ("a blue car", _p(2, num_images_per_prompt=3)), ("bad", _p(3))]
    outs = sync_engine.generate([p for p, _ in jobs], [q for _, q in jobs])
    assert [o.status for o in outs] == [RequestStatus.FINISHED, RequestStatus.FINISHED, RequestStatus.FAILED]
    # step 1 shared (2 + 6 + 2 rows), step 2 failed shared and retried alone, step 3 shared again
    assert outs[0].metrics.batch_sizes == {10: 1, 2: 1, 8: 1}
    assert outs[1].metrics.batch_sizes == {10: 1, 6: 1, 8: 1}
    monkeypatch.setattr(adapter, "step", step)
    for (prompt, params), out in zip(jobs[:2], outs):
        [alone] = sync_engine.generate(prompt, params)
        assert np.abs(out.images - alone.images).max() <= TOL


def test_non_finite_latents_fail_only_that_request(engine, monkeypatch):
    adapter = engine.runner.adapter
    original = adapter.combine

    def poisoned(batch, out):
        guided = original(batch, out)
        rows = batch.split(guided)
        for state, r in zip(batch.states, rows):
            if "overflow" in state.prompt:
                r.fill_(float("nan"))
        return guided

    monkeypatch.setattr(adapter, "combine", poisoned)
    before = engine.stats()["nonfinite_outputs"]
    outs = engine.generate(["fine", "fp16 overflow", "also fine"], [_p(1), _p(2), _p(3)])
    assert [o.status for o in outs] == [RequestStatus.FINISHED, RequestStatus.FAILED, RequestStatus.FINISHED]
    assert outs[1].error_type == "NonFiniteOutputError" and "NaN" in outs[1].error
    assert np.isfinite(outs[0].images).all() and np.isfinite(outs[2].images).all()
    assert engine.stats()["nonfinite_outputs"] == before + 1


def test_non_finite_pixels_are_caught_before_pil_conversion(engine, monkeypatch):
    vae = engine.runner.adapter.pipe.vae
    original = vae.decode

    def nan_decode(latents, *args, **kwargs):
        image = original(latents, *args, **kwargs)[0]
        return (image * float("inf"),)

    monkeypatch.setattr(vae, "decode", nan_decode)
    [out] = engine.generate("pil output", SamplingParams(seed=1, num_inference_steps=2))  # output_type pil
    assert not out.ok and out.error_type == "NonFiniteOutputError" and out.images == []


# ------------------------------------------------------------------- engine death
def test_dead_engine_loop_fails_requests_fast(tiny_sd3_dir):
    engine = DiffusionEngine(EngineConfig(model=str(tiny_sd3_dir)))

    def die():
        raise SystemExit("simulated fatal error in the engine thread")

    async def main():
        async_engine = AsyncDiffusionEngine(engine=engine)
        first = async_engine.generate("doomed", _p(1, steps=50))
        events = []
        engine.step = die  # the loop thread dies at its next step
        start = time.perf_counter()
        async for event in first:
            events.append(event)
        waited = time.perf_counter() - start
        with pytest.raises(EngineDeadError, match="simulated fatal error"):
            async for _ in async_engine.generate("after", _p(2)):
                pass
        return events, waited, async_engine

    events, waited, async_engine = asyncio.run(main())
    assert events[-1].output.status is RequestStatus.FAILED and "engine loop died" in events[-1].error
    assert waited < 5.0
    assert not async_engine.is_running and "SystemExit" in async_engine.error


def test_fail_unfinished_keeps_every_event(sync_engine):
    ids = [sync_engine.add_request(f"r{i}", _p(i)) for i in range(3)]
    events = sync_engine.fail_unfinished("boom")
    finals = {e.request_id: e for e in events if e.type.is_final}
    assert set(finals) == set(ids) and all("boom" in e.error for e in finals.values())
    queued = [e for e in events if e.type.value == "queued"]
    assert len(queued) == 3  # the pending queued events were not dropped
    assert not sync_engine.has_unfinished_requests()


# ------------------------------------------------------------------ long prompts
def test_huge_prompt_is_cut_before_tokenizing_and_flagged(engine):
    adapter = engine.runner.adapter
    calls = []
    tokenizer = adapter.pipe.tokenizer
    original = tokenizer.__class__.__call__

    def spy(self, text, *args, **kwargs):
        calls.append(len(text) if isinstance(text, str) else max(len(t) for t in text))
        return original(self, text, *args, **kwargs)

    huge = "a lighthouse at dusk " * 1600  # 33,600 characters
    tokenizer.__class__.__call__ = spy
    try:
        [out] = engine.generate(huge, _p(5, steps=1))
    finally:
        tokenizer.__class__.__call__ = original
    assert out.ok and out.prompt_truncated
    assert calls and max(calls) <= 77 * 32  # never the whole text
    # same image as the prompt cut to what the encoder keeps anyway
    [cut] = engine.generate(huge[: 77 * 32], _p(5, steps=1))
    np.testing.assert_array_equal(out.images, cut.images)


def test_negative_prompt_truncation_is_reported(engine):
    [out] = engine.generate("short", _p(1, steps=1, negative_prompt="blurry " * 200))
    assert out.ok and out.negative_prompt_truncated and not out.prompt_truncated


# ----------------------------------------------------------- prompt cache bytes
def test_prompt_cache_stores_one_row_per_text(tiny_sd3_dir):
    engine = DiffusionEngine(EngineConfig(model=str(tiny_sd3_dir), prompt_embed_cache_bytes=10**9))
    engine.generate("ten images", _p(1, steps=1, num_images_per_prompt=10))
    one = engine.stats()["acceleration"]["prompt_embed_cache"]
    engine.generate("one image", _p(1, steps=1))
    two = engine.stats()["acceleration"]["prompt_embed_cache"]
    # two texts ("" and "ten images"), then one more: equal bytes per text whatever n was
    assert one["size"] == 2 and two["size"] == 3
    assert two["bytes"] - one["bytes"] == one["bytes"] // 2


def test_prompt_cache_byte_bound_holds(tiny_sd3_dir):
    engine = DiffusionEngine(EngineConfig(model=str(tiny_sd3_dir), prompt_embed_cache_bytes=30_000))
    for i in range(8):
        engine.generate(f"prompt number {i}", _p(i, steps=1))
    stats = engine.stats()["acceleration"]["prompt_embed_cache"]
    assert 0 < stats["bytes"] <= 30_000 and stats["evictions"] > 0


# ------------------------------------------------------------------ loader errors
def test_missing_weight_file_is_one_line_naming_it(tiny_sd3_dir, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(tiny_sd3_dir, broken)
    (broken / "transformer" / "diffusion_pytorch_model.safetensors").unlink()
    with pytest.raises(UnsupportedModelError) as info:
        DiffusionEngine(EngineConfig(model=str(broken)))
    message = str(info.value)
    assert "transformer" in message and "diffusion_pytorch_model" in message and "\n" not in message


@pytest.mark.parametrize("model,fragment", [
    ("/no/such/folder", "does not exist"),
    ("nobody-org/no-such-model", "not in the Hugging Face cache and HF_HUB_OFFLINE is set"),
])
def test_missing_folder_and_hub_id_messages(model, fragment):
    with pytest.raises(UnsupportedModelError, match=fragment):
        DiffusionEngine(EngineConfig(model=model))


def test_torch_threads_are_respected():
    assert torch.get_num_threads() == 1  # conftest pins one thread for deterministic timing
