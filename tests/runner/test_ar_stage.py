"""The AR stage runner (`diffserve.runner.ar_stage`) on the tiny GLM-Image folder (batched
``generate`` with per-request seeded sampling): equal to diffusers' own AR stage seed for seed,
batched or alone; aborts and failures stay per request; payloads freed."""

from __future__ import annotations

import threading

import pytest
import torch

from diffserve.connector.inprocess import InProcessConnector
from diffserve.runner.ar_stage import ARAbortedError, ARStageRunner
from diffserve.runner.loader import load_ar_stage
from diffserve.core.sampling_params import SamplingParams

PROMPTS = ["A photo of a cat", "a sign that says 'hi'", "dog"]


def params(seed: int) -> SamplingParams:
    return SamplingParams(seed=seed, height=32, width=32)


@pytest.fixture(scope="module")
def glm_stage(tiny_glm_image_dir):
    return load_ar_stage(tiny_glm_image_dir, torch.device("cpu"), torch.float32)


def test_batched_generation_equals_diffusers_prior_tokens_seed_for_seed(tiny_glm_image_dir, glm_stage):
    from diffusers import GlmImagePipeline

    connector = InProcessConnector()
    runner = ARStageRunner(glm_stage, connector)
    try:
        futures = [runner.submit(f"r{i}", p, params(10 + i)) for i, p in enumerate(PROMPTS)]
        done = [f.result(timeout=120) for f in futures]
    finally:
        runner.shutdown()
    assert runner.stats()["rounds"] >= 1 and all(d.text is None and d.num_tokens == 258 for d in done)
    pipe = GlmImagePipeline.from_pretrained(tiny_glm_image_dir)
    for i, (prompt, d) in enumerate(zip(PROMPTS, done)):
        ref, _, _ = pipe.generate_prior_tokens(prompt, 32, 32, generator=torch.Generator().manual_seed(10 + i),
                                               device=torch.device("cpu"))
        got = connector.get(d.handle, ["cond"])["cond"].tensors["prior_token_ids"]
        assert torch.equal(got, ref[0])
    for i in range(3):
        runner.free([f"r{i}"])
    assert connector.stats().resident_bytes == 0


def test_abort_and_failure_stay_per_request(glm_stage, monkeypatch):
    connector = InProcessConnector()
    runner = ARStageRunner(glm_stage, connector, max_batch=1)
    gate = threading.Event()
    generate = type(glm_stage).generate

    def slow_generate(self, batch):
        gate.wait(timeout=30)
        if batch[0].prompt == "boom":
            raise RuntimeError("injected AR failure")
        return generate(self, batch)

    monkeypatch.setattr(type(glm_stage), "generate", slow_generate)
    try:
        first = runner.submit("a", "first", params(1))  # generating (blocked at the gate)
        waiting = runner.submit("b", "waiting", params(2))  # queued behind it
        failing = runner.submit("c", "boom", params(3))
        runner.abort("b")
        gate.set()
        assert first.result(timeout=120).num_tokens == 258
        with pytest.raises(ARAbortedError):
            waiting.result(timeout=10)
        with pytest.raises(RuntimeError, match="injected AR failure"):
            failing.result(timeout=120)
        runner.abort("a")  # after it finished: its payloads go
    finally:
        runner.shutdown()
    s = connector.stats()
    assert s.resident_requests == 0 and s.resident_bytes == 0
    assert runner.stats()["aborted"] == 1 and runner.stats()["failed"] == 1


@pytest.mark.parametrize("connector_name", ["inprocess", "shared_memory"])
def test_random_aborts_leave_no_payload(connector_name):
    """200 requests through the built-in model's AR stage (continuous batching), each aborted at
    a random moment (waiting, generating, exporting, or after its payloads were put): once every
    finished one is freed too, nothing is held and no segment is left."""
    import random
    import time

    from diffserve.connector import make_connector
    from diffserve.connector.shared_memory import leaked_segments
    from diffserve.models import BUILTIN_MODELS

    before = set(leaked_segments())
    stage = load_ar_stage(BUILTIN_MODELS["digits-reasoning"], torch.device("cpu"), torch.float32)
    connector = make_connector(connector_name)
    runner = ARStageRunner(stage, connector, max_batch=16)
    rng = random.Random(0)
    futures = {}
    try:
        for i in range(200):
            futures[f"r{i}"] = runner.submit(f"r{i}", ["three plus four", "twice 2", "the number after 8"][i % 3],
                                             SamplingParams(guidance_scale=4.0 if i % 2 else 1.0))
            if rng.random() < 0.5:
                time.sleep(rng.random() * 0.002)
            victim = f"r{rng.randrange(i + 1)}"
            runner.abort(victim)
        outcomes = {"done": 0, "aborted": 0}
        for request_id, future in futures.items():
            try:
                future.result(timeout=60)
                outcomes["done"] += 1
            except ARAbortedError:
                outcomes["aborted"] += 1
            runner.free([request_id])
    finally:
        runner.shutdown()
    s = connector.stats()
    assert outcomes["aborted"] > 20 and s.resident_requests == 0 and s.resident_bytes == 0, (outcomes, s)
    assert set(leaked_segments()) == before


def test_payloads_under_continuous_batching_equal_a_solo_export():
    """The K/V exported while transformers' continuous-batching loop keeps generating for other
    requests equal the K/V of the same sequence exported alone (the loop is paused for each export:
    without it a forward beside the loop came out wrong)."""
    import time

    from diffserve.models import BUILTIN_MODELS
    from diffserve.pipelines.ar_context import export_kv

    stage = load_ar_stage(BUILTIN_MODELS["digits-reasoning"], torch.device("cpu"), torch.float32)
    connector = InProcessConnector()
    runner = ARStageRunner(stage, connector, max_batch=8)
    prompts = ["three plus four", "twice 3", "the number before 9", "half of 8", "5 minus two", "0 plus 0"]
    stop = threading.Event()

    def keep_generating() -> None:  # other requests keep the loop busy while the measured ones export
        n = 0
        while not stop.is_set():
            filler = [runner.submit(f"f{n}-{k}", "twice 3", SamplingParams(guidance_scale=1.0)) for k in range(16)]
            for future in filler:
                future.result(timeout=60)
            runner.free([f"f{n}-{k}" for k in range(16)])
            n += 1

    thread = threading.Thread(target=keep_generating)
    thread.start()
    try:
        futures = []
        for wave in range(4):
            for k, prompt in enumerate(prompts):  # one at a time: each exports while the loop runs the others
                futures.append(runner.submit(f"w{wave}-{k}", prompt, SamplingParams(guidance_scale=1.0)))
                time.sleep(0.003)
        payloads = [connector.get(future.result(timeout=60).handle, ["cond"])["cond"] for future in futures]
    finally:
        stop.set()
        thread.join(timeout=60)
        runner.shutdown()
    for payload in payloads:  # the loop is stopped: these exports run alone
        [alone] = export_kv(stage.language_model, [payload.meta["token_ids"]], stage.tokenizer.pad_token_id)
        torch.testing.assert_close(payload.tensors["kv"], alone, atol=1e-5, rtol=0)
