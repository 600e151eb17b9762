"""The DiT stage's runner with an AR stage before it (the built-in `digits-reasoning`): payloads
received through the connector (prefetched at admission), step batches that mix requests whose
AR contexts differ in length (padding + masks) equal each request's solo run, a missing guidance
branch fails its request clearly, and freeing drops every payload."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from diffserve.config import EngineConfig
from diffserve.connector.handles import PayloadHandle
from diffserve.core.messages import NewRequest
from diffserve.core.sampling_params import RequestLimits, SamplingParams
from diffserve.executor.ar_stage import InProcessARStage
from diffserve.runner.model_runner import ModelRunner

pytestmark = pytest.mark.usefixtures("one_torch_thread")

#: prompts whose AR contexts (prompt + answer) have different lengths: 5, 7 and 8 tokens
PROMPTS = ["twice 2", "three plus four", "the number after 8"]


@pytest.fixture(scope="module")
def stages():
    config = EngineConfig(model="digits-reasoning", num_threads=1)
    runner = ModelRunner(config)
    ar = InProcessARStage(config, runner.connector)
    yield runner, ar
    ar.shutdown()


def resolved(runner, **fields) -> SamplingParams:
    return SamplingParams(output_type="np", num_inference_steps=4, **fields).resolve(runner.info().spec,
                                                                                    RequestLimits(), 0)


def run_to_end(runner, news: list[NewRequest]) -> list[np.ndarray]:
    for new in news:
        runner.prefetch(new.request_id, new.context, new.params)
    prepared = runner.prepare(news)
    assert all(p.error is None for p in prepared), [p.error for p in prepared]
    ids = [n.request_id for n in news]
    while any(not runner.states[i].done for i in ids):
        out = runner.step(ids)
        assert not out.errors
    return [np.asarray(d.output) for d in runner.decode(ids)]


def test_mixed_context_lengths_share_steps_and_equal_solo_runs(stages):
    runner, ar = stages
    params = [resolved(runner, seed=i, guidance_scale=4.0) for i in range(len(PROMPTS))]
    futures = [ar.submit(f"m{i}", p, params[i]) for i, p in enumerate(PROMPTS)]
    done = [f.result(timeout=60) for f in futures]
    lengths = {runner.connector.get(d.handle, ["cond"])["cond"].tensors["kv"].shape[0] for d in done}
    assert len(lengths) == 3  # three context lengths in one batch
    parts = [runner.connector.get(d.handle) for d in done]  # (decoding frees the request's payloads)
    batched = run_to_end(runner, [NewRequest(f"m{i}", p, params[i], context=d.handle)
                                  for i, (p, d) in enumerate(zip(PROMPTS, done))])
    for i, (prompt, d) in enumerate(zip(PROMPTS, done)):  # the same payloads, one request at a time
        handle = runner.connector.put(f"s{i}", parts[i])
        [solo] = run_to_end(runner, [NewRequest(f"s{i}", prompt, params[i], context=handle)])
        np.testing.assert_allclose(batched[i], solo, atol=1e-4, rtol=0)
        ar.free([f"m{i}"])
    s = runner.connector.stats()
    assert s.resident_requests == 0 and s.resident_bytes == 0 and s.dedup_hits >= 2
    assert not runner.states


def test_missing_guidance_branch_fails_only_that_request(stages):
    runner, ar = stages
    guided = resolved(runner, seed=1, guidance_scale=4.0)
    unguided = resolved(runner, seed=2, guidance_scale=1.0)
    a = ar.submit("unguided", "twice 3", unguided).result(timeout=60)  # only a "cond" payload
    b = ar.submit("ok", "twice 4", guided).result(timeout=60)
    lying = PayloadHandle("unguided", a.handle.connector, a.handle.parts)
    prepared = runner.prepare([NewRequest("unguided", "twice 3", guided, context=lying),
                               NewRequest("ok", "twice 4", guided, context=b.handle)])
    assert prepared[0].error is not None and "'negative' branch payload is missing" in str(prepared[0].error)
    assert prepared[1].error is None and prepared[1].payload_bytes > 0
    runner.free(["ok"])
    ar.free(["unguided", "ok"])
    assert runner.connector.stats().resident_bytes == 0
