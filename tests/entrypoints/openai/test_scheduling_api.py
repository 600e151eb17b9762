"""HTTP extensions of issue 27: ``priority`` and ``deadline_s`` on generation requests (bad
values are 400 naming the field), ``--admission slo`` refusals (429 ``deadline_unmeetable``),
and the scheduler's counters on ``/metrics``."""

from __future__ import annotations

import httpx
import pytest
from server_helpers import assert_openai_error, new_engine, serve

from diffserve.entrypoints.openai.app import create_app

FAST = {"num_inference_steps": 2, "size": "8x8"}


@pytest.fixture(scope="module")
def engine():
    engine = new_engine("digits", scheduling_policy="slo", admission="slo")
    try:
        yield engine
    finally:
        engine.shutdown()


@pytest.mark.parametrize("field,value", [("priority", "high"), ("priority", 1.5), ("priority", 2**31),
                                         ("deadline_s", 0), ("deadline_s", -2.5), ("deadline_s", "soon"),
                                         pytest.param("deadline_s", 10**400, id="deadline_s-1e400"),
                                         pytest.param("deadline_s", -10**400, id="deadline_s--1e400")])
def test_bad_priority_or_deadline_is_400_naming_the_field(engine, field, value):
    with serve(create_app(engine, "m")) as base:
        resp = httpx.post(f"{base}/v1/images/generations", json={"prompt": "a 7", field: value, **FAST}, timeout=30)
        assert_openai_error(resp, 400, field)


def test_priority_deadline_refusal_and_metrics(engine):
    with serve(create_app(engine, "m")) as base:
        ok = httpx.post(f"{base}/v1/images/generations",
                        json={"prompt": "a 7", "priority": -2, "deadline_s": 600, **FAST}, timeout=60)
        assert ok.status_code == 200, ok.text
        refused = httpx.post(f"{base}/v1/images/generations",
                             json={"prompt": "a 7", "deadline_s": 1e-9, **FAST, "num_inference_steps": 50},
                             timeout=60)
        assert_openai_error(refused, 429, param="deadline_s", code="deadline_unmeetable")
        assert "deadline_s" in refused.json()["error"]["message"]
        text = httpx.get(f"{base}/metrics", timeout=30).text
        for name in ("diffserve_rows_per_forward_mean", "diffserve_tokens_per_forward_mean", "diffserve_preemptions",
                     "diffserve_slo_attainment", "diffserve_goodput_images_per_second", "diffserve_padded_token_share",
                     'diffserve_queue_delay_seconds_mean{priority="-2"}', "diffserve_deadline_refusals_total 1.0",
                     "diffserve_join_waits_total"):
            assert name in text, name
