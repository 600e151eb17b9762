"""Multi-stage models through the engine (an AR stage before the DiT stage, payloads through the
connector): the built-in `digits-reasoning` answers and draws the answer, its text streams as
``ar_delta`` events before the DiT stage starts, a request whose AR stage fails fails alone,
requests aborted at random points (in the AR stage, waiting with their payloads, in the DiT
stage) leave no payload behind, and the AR stage in its own process (payloads through shared
memory) gives the same images as in-process and leaves no segment behind, and a program that never
shuts its engine down still exits."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from diffserve import DiffusionEngine, EngineConfig, SamplingParams
from diffserve.core.outputs import EventType, RequestStatus

import quality  # benchmarks/quality.py (tests/conftest.py puts benchmarks/ on sys.path)
from training.digits_reasoning import grammar

pytestmark = pytest.mark.usefixtures("one_torch_thread")

#: held-out prompts of the model's grammar (wordings never trained) and their answers
HELD = grammar.split()[1]
PROBLEMS = [HELD[k * 11 % len(HELD)] for k in range(8)]


@pytest.fixture(scope="module")
def engine():
    engine = DiffusionEngine(EngineConfig(model="digits-reasoning", num_threads=1, max_batch_size=16))
    yield engine
    engine.shutdown()


def params(seed: int, steps: int = 10, **fields) -> SamplingParams:
    return SamplingParams(seed=seed, num_inference_steps=steps, output_type="np", **fields)


def resident(engine) -> tuple[int, int]:
    """(resident payload bytes on the AR side, requests the DiT side still holds)."""
    stats = engine.stats()
    return stats["ar_stage"]["connector"]["resident_bytes"], stats["payloads"]["pending"]


def test_answers_draw_the_answer_and_stream_the_text_first(engine):
    events: list = []
    outputs = engine.generate([p.prompt for p in PROBLEMS], [params(k) for k in range(len(PROBLEMS))],
                              on_event=events.append)
    assert all(o.ok for o in outputs), [o.error for o in outputs]
    assert [o.ar_text for o in outputs] == [p.answer_text for p in PROBLEMS]
    clf, _ = quality.build_judge()
    images = np.stack([np.asarray(o.images)[0, :, :, 0] for o in outputs])
    assert np.mean(quality.judge_images(clf, images) == [p.answer for p in PROBLEMS]) >= 0.75
    for out in outputs:  # queued, the AR text, then the DiT stage's events
        kinds = [e.type for e in events if e.request_id == out.request_id]
        assert kinds[0] is EventType.QUEUED and kinds[-1] is EventType.FINISHED
        deltas = [i for i, k in enumerate(kinds) if k is EventType.AR_DELTA]
        assert deltas and max(deltas) < kinds.index(EventType.STARTED)
        text = "".join(e.text for e in events if e.request_id == out.request_id and e.type is EventType.AR_DELTA)
        assert text == out.ar_text
        m = out.metrics
        assert m.payload_bytes > 0 and m.ar_s > 0 and m.transfer_s > 0 and m.payload_wait_s >= 0
        assert {"ar_s", "transfer_s", "payload_wait_s", "payload_bytes"} <= set(m.as_dict())
    stats = engine.stats()
    assert stats["ar_stage"]["finished"] >= len(PROBLEMS) and stats["payloads"]["received"] >= len(PROBLEMS)
    assert stats["payloads"]["connector"]["dedup_hits"] >= len(PROBLEMS) - 1  # one shared empty negative prompt
    assert resident(engine) == (0, 0)


def test_a_failing_ar_stage_fails_only_its_request(engine, monkeypatch):
    model = engine.ar_stage.runner.model
    products = model.products

    def failing(inputs, generated):
        if any(i.prompt == "half of 8" for i in inputs):
            raise RuntimeError("injected export failure")
        return products(inputs, generated)

    monkeypatch.setattr(model, "products", failing)
    ok, bad = engine.generate(["twice 3", "half of 8"], [params(1, steps=4), params(2, steps=4)])
    assert ok.ok and ok.ar_text == "six"
    assert bad.status is RequestStatus.FAILED and "injected export failure" in bad.error and bad.images == []
    assert resident(engine) == (0, 0)


def test_random_aborts_leave_no_payload(engine):
    from diffserve.memory.accounting import release_host_memory, rss_bytes

    release_host_memory()
    rss_before = rss_bytes()
    rng = random.Random(0)
    problems = grammar.all_problems()
    ids = [engine.add_request(problems[k * 7 % len(problems)].prompt, params(k, steps=6)) for k in range(200)]
    pending = list(ids)
    rng.shuffle(pending)
    aborted = {"ar_stage": 0, "waiting": 0, "running": 0}
    final = {}
    while engine.has_unfinished_requests():
        for event in engine.step():
            if event.type.is_final:
                final[event.request_id] = event.output.status
        for _ in range(rng.randint(0, 6)):  # abort a few, wherever they are now
            if pending:
                request_id = pending.pop()
                request = engine.scheduler.requests.get(request_id)
                if request is not None:
                    phase = request.phase.value
                    aborted["running" if phase in ("preparing", "denoising", "decoding") else phase] += 1
                engine.abort(request_id)
    assert len(final) == 200 and all(s in (RequestStatus.ABORTED, RequestStatus.FINISHED) for s in final.values())
    assert all(aborted.values()), aborted  # aborts hit every stage
    time.sleep(0.5)  # AR-side aborts resolve on the stage's threads
    assert resident(engine) == (0, 0)
    assert not engine.runner.states and engine.stats()["ar_stage"]["waiting"] == 0
    release_host_memory()
    growth = rss_bytes() - rss_before
    assert growth < 64 * 2**20, f"RSS grew by {growth / 2**20:.1f} MiB"  # payloads are ~30 KB a request


def test_own_process_and_shared_memory_give_the_same_images(engine):
    prompts = [p.prompt for p in PROBLEMS[:4]]
    fields = [params(10 + k, steps=6, guidance_scale=4.0) for k in range(len(prompts))]
    # one request at a time: the same forwards on both sides (batched runs differ in float rounding)
    local = [engine.generate(p, f)[0] for p, f in zip(prompts, fields)]
    mp_engine = DiffusionEngine(EngineConfig(model="digits-reasoning", num_threads=1, max_batch_size=16,
                                             executor="multiprocess"))
    ar_pid = mp_engine.ar_stage._proc.pid
    try:
        remote = [mp_engine.generate(p, f)[0] for p, f in zip(prompts, fields)]
        for a, b in zip(local, remote):
            assert b.ok and a.ar_text == b.ar_text
            np.testing.assert_array_equal(np.asarray(a.images), np.asarray(b.images))
        batched = mp_engine.generate(prompts, fields)  # concurrent: shared steps, within float rounding
        for a, b in zip(local, batched):
            np.testing.assert_allclose(np.asarray(a.images), np.asarray(b.images), atol=1e-4, rtol=0)
        ids = [mp_engine.add_request(prompts[k % 4], params(k, steps=6)) for k in range(12)]
        for request_id in ids[::3]:
            mp_engine.abort(request_id)
        while mp_engine.has_unfinished_requests():
            mp_engine.step()
        time.sleep(0.5)
        stats = mp_engine.stats()
        assert stats["ar_stage"]["connector"]["resident_bytes"] == 0 and stats["payloads"]["pending"] == 0
        assert stats["payloads"]["connector"]["bytes_copied"] == 0  # mapped, not copied
    finally:
        mp_engine.shutdown()
    shm = Path("/dev/shm")
    if shm.is_dir():
        assert not list(shm.glob(f"diffserve-{ar_pid}-*")), "shared-memory segments left behind"


def test_a_program_that_never_shuts_its_engine_down_still_exits():
    """transformers' continuous-batching thread is not a daemon: the runner stops it when the
    interpreter exits, so a script (or the CLI) that forgets `shutdown()` exits instead of
    waiting forever."""
    script = ("from diffserve import DiffusionEngine, EngineConfig, SamplingParams\n"
              "engine = DiffusionEngine(EngineConfig(model='digits-reasoning', num_threads=1))\n"
              "[out] = engine.generate(['twice 4'], [SamplingParams(seed=1, num_inference_steps=2)])\n"
              "print(out.ar_text)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[2]),
                                                                      os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-1] == "eight"
