"""``cache_quality`` over HTTP: the served schema states exactly the levels the engine takes
(every level with ``--cache-backend teacache``, only ``max`` without a cache backend), a
request's level, skipped steps and error estimate come back in ``timings`` and reach
``/metrics``, and a level the engine cannot honour is a 400 naming the field."""

from __future__ import annotations

import httpx
import pytest
import torch

from diffserve.entrypoints.openai.app import create_app
from server_helpers import assert_openai_error, new_engine, serve

torch.set_num_threads(1)
FAST = {"num_inference_steps": 12, "size": "64x64", "seed": 3, "response_format": "b64_json"}
LEVELS = {"fast": {"interval": 4, "warmup_steps": 2, "budget": None}}


@pytest.fixture(scope="module", params=["teacache", "none"])
def server(request, tiny_sd3_dir):
    options = {"cache_quality": "high", "levels": LEVELS} if request.param == "teacache" else {}
    engine = new_engine(tiny_sd3_dir, cache_backend=request.param, cache_config=options)
    with serve(create_app(engine, "tiny-sd3")) as base:
        yield base, request.param


def _levels(base: str, path: str = "/v1/images/generations") -> list[str]:
    schema = httpx.get(f"{base}/openapi.json").json()["paths"][path]["post"]["requestBody"]["content"]
    prop = schema["application/json" if "application/json" in schema else "multipart/form-data"]["schema"]
    branches = prop["properties"]["cache_quality"]["anyOf"]
    return next(b["enum"] for b in branches if b.get("type") == "string")


def test_levels_in_schema_timings_and_metrics(server):
    base, backend = server
    post = lambda body: httpx.post(f"{base}/v1/images/generations", json=body, timeout=60)  # noqa: E731
    if backend == "none":
        assert _levels(base) == ["max"]
        assert "cache_quality" not in post({"prompt": "a cat", "cache_quality": "max", **FAST}).json()["data"][0]["timings"]
        assert_openai_error(post({"prompt": "a cat", "cache_quality": "fast", **FAST}), 400, "cache_quality")
        return
    assert _levels(base) == ["max", "high", "balanced", "fast"]
    fast = post({"prompt": "a cat", "cache_quality": "fast", **FAST})
    assert fast.status_code == 200, fast.text
    timings = fast.json()["data"][0]["timings"]
    assert timings["cache_quality"] == "fast" and timings["cache_skipped_steps"] > 0
    assert timings["cache_error_estimate"] > 0
    default = post({"prompt": "a cat", **FAST}).json()["data"][0]["timings"]
    assert default["cache_quality"] == "high"  # the server's default (--cache-config)
    assert_openai_error(post({"prompt": "a cat", "cache_quality": "ultra", **FAST}), 400, "cache_quality")
    metrics = httpx.get(f"{base}/metrics").text
    assert f'diffserve_request_cache_skipped_steps_total{{cache_quality="fast"}} {float(timings["cache_skipped_steps"])}' \
        in metrics
    assert 'diffserve_request_cache_error_estimate_count{cache_quality="high"} 1.0' in metrics
