"""The OpenAI-compatible server, run for real (uvicorn on a free localhost port, in a thread),
driven by the official `openai` client and by raw HTTP."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import httpx
import numpy as np
import openai
import pytest
import torch
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from diffserve.entrypoints.openai.app import create_app
from diffserve.entrypoints.openai.stores.image_store import ImageStore
from diffserve.entrypoints.openai.ops.metrics import ServerMetrics
from diffserve.entrypoints.openai.protocol import ImageGenerationRequest
from diffserve.entrypoints.openai.services.images import ImageGenerationService
from diffserve.core.errors import EngineOverloadedError
from server_helpers import LONG_STEPS, assert_openai_error, new_engine, serve, wait_until

torch.set_num_threads(1)

MODEL = "tiny-sd3"
FAST = {"num_inference_steps": 2}


# ------------------------------------------------------------------------------- helpers
def decode(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"), dtype=np.int16)


def scrape(base: str) -> dict[tuple[str, tuple], float]:
    """/metrics as {(sample name, sorted labels): value}, parsed with prometheus_client."""
    text = httpx.get(f"{base}/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.fixture(scope="module")
def server(tiny_sd3_dir):
    engine = new_engine(tiny_sd3_dir, max_batch_size=16)
    with serve(create_app(engine, MODEL)) as base:
        yield SimpleNamespace(base=base, engine=engine,
                              client=openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0))


# ------------------------------------------------------------------------ openai client
def test_openai_client_b64_json(server):
    resp = server.client.images.generate(prompt="a red square", model=MODEL, size="64x48",
                                         extra_body={**FAST, "seed": 3})
    assert len(resp.data) == 1 and resp.data[0].url is None
    image = Image.open(io.BytesIO(base64.b64decode(resp.data[0].b64_json)))
    assert image.format == "PNG" and image.size == (64, 48)
    assert resp.data[0].seed == 3
    timings = resp.data[0].timings
    assert {"queue_s", "encode_s", "denoise_s", "decode_s", "total_s"} <= set(timings)
    assert timings["num_steps"] == 2 and resp.size == "64x48" and resp.id.startswith("img-")


def test_openai_client_url(server):
    resp = server.client.images.generate(prompt="a cat", response_format="url", output_format="webp",
                                         output_compression=80, size="auto", extra_body=FAST)
    url = resp.data[0].url
    assert resp.data[0].b64_json is None and url.startswith(server.base + "/v1/images/files/")
    assert resp.data[0].expires_at > time.time() + 60
    fetched = httpx.get(url)
    assert fetched.status_code == 200 and fetched.headers["content-type"] == "image/webp"
    assert Image.open(io.BytesIO(fetched.content)).size == (64, 64)  # "auto" = the model default
    assert_openai_error(httpx.get(f"{server.base}/v1/images/files/nope.png"), 404)


def test_n3_distinct_and_reproducible_by_seed(server):
    def generate(n, seed):
        resp = server.client.images.generate(prompt="a dog", n=n, extra_body={**FAST, "seed": seed})
        return [decode(d.b64_json) for d in resp.data], [d.seed for d in resp.data]

    first, seeds = generate(3, 123)
    again, _ = generate(3, 123)
    alone, alone_seeds = generate(1, 125)
    assert seeds == [123, 124, 125] and alone_seeds == [125]
    for i in range(3):
        for j in range(i + 1, 3):
            assert np.abs(first[i] - first[j]).mean() > 1.0, "images of one request must differ"
    # Batched vs alone is not bit-identical (float sums); allow one uint8 level.
    for a, b in zip(first, again):
        assert np.abs(a - b).max() <= 1
    assert np.abs(first[2] - alone[0]).max() <= 1, "image i must be reproducible alone with seed + i"


def test_streaming_partial_images(server):
    stream = server.client.images.generate(prompt="a tree", stream=True, partial_images=2, output_format="jpeg",
                                           extra_body={"num_inference_steps": 6, "seed": 1})
    events = list(stream)
    assert [e.type for e in events] == ["image_generation.partial_image"] * 2 + ["image_generation.completed"]
    assert [e.partial_image_index for e in events[:2]] == [0, 1]
    for event in events:
        image = Image.open(io.BytesIO(base64.b64decode(event.b64_json)))
        assert image.format == "JPEG" and image.size == (64, 64) and event.size == "64x64"
    assert events[-1].seed == 1 and events[-1].output_format == "jpeg"


# --------------------------------------------------------------------------- batching
def test_simultaneous_requests_are_batched(server):
    before = scrape(server.base)
    body = {"prompt": "a boat", "model": MODEL, "num_inference_steps": 4, "seed": 9}
    barrier = threading.Barrier(8)
    results: list[httpx.Response | BaseException] = [None] * 8  # type: ignore[list-item]

    def post(i):
        barrier.wait()
        try:
            results[i] = httpx.post(f"{server.base}/v1/images/generations", json=body, timeout=60)
        except BaseException as exc:  # noqa: BLE001
            results[i] = exc

    threads = [threading.Thread(target=post, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(isinstance(r, httpx.Response) and r.status_code == 200 for r in results), results
    payloads = [r.json() for r in results]
    assert len({p["id"] for p in payloads}) == 8
    biggest = max(int(rows) for p in payloads for rows in p["data"][0]["timings"]["batch_sizes"])
    assert biggest > 2, "8 simultaneous CFG requests (2 rows each) should share steps"
    after = scrape(server.base)
    key = ("diffserve_step_batch_requests_bucket", (("le", "1.0"),))
    count = ("diffserve_step_batch_requests_count", ())
    steps_with_many = (after[count] - after[key]) - (before[count] - before[key])
    assert steps_with_many > 0
    assert after[("diffserve_requests_total", (("status", "200"),))] \
        - before.get(("diffserve_requests_total", (("status", "200"),)), 0) == 8


# ----------------------------------------------------------------------------- errors
INVALID = [
    ({"prompt": "x", "foo": 1}, 400, "foo"),
    ('{"prompt": ', 400, None),
    ("[1, 2]", 400, None),
    ("", 400, None),
    ({}, 400, "prompt"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": 123}, 400, "prompt"),
    ({"prompt": "x", "n": 0}, 400, "n"),
    ({"prompt": "x", "n": 10**9}, 400, "n"),
    ({"prompt": "x", "n": "3"}, 400, "n"),
    ({"prompt": "x", "n": 2.5}, 400, "n"),
    ({"prompt": "x", "size": "abc"}, 400, "size"),
    ({"prompt": "x", "size": "65x64"}, 400, "size"),
    ({"prompt": "x", "size": "0x64"}, 400, "size"),
    ({"prompt": "x", "size": "8192x8192"}, 400, "size"),
    ({"prompt": "x", "size": "1024x1024"}, 400, "size"),  # over the tiny model's 512 px maximum
    ({"prompt": "x", "size": "9" * 5000 + "x16"}, 400, "size"),
    ({"prompt": "x", "size": 64}, 400, "size"),
    ({"prompt": "x", "num_inference_steps": 0}, 400, "num_inference_steps"),
    ({"prompt": "x", "num_inference_steps": 10**6}, 400, "num_inference_steps"),
    ({"prompt": "x", "guidance_scale": -1}, 400, "guidance_scale"),
    ('{"prompt": "x", "guidance_scale": NaN}', 400, "guidance_scale"),
    ({"prompt": "x", "seed": -1}, 400, "seed"),
    ({"prompt": "x", "seed": 2**64}, 400, "seed"),
    ({"prompt": "x", "seed": 2**63, "n": 2}, 400, "seed"),
    ({"prompt": "x", "negative_prompt": ["a"]}, 400, "negative_prompt"),
    ({"prompt": "x", "response_format": "html"}, 400, "response_format"),
    ({"prompt": "x", "output_format": "gif"}, 400, "output_format"),
    ({"prompt": "x", "output_compression": 101}, 400, "output_compression"),
    ({"prompt": "x", "quality": "ultra"}, 400, "quality"),
    ({"prompt": "x", "style": "weird"}, 400, "style"),
    ({"prompt": "x", "background": "transparent"}, 400, "background"),
    ({"prompt": "x", "moderation": "none"}, 400, "moderation"),
    ({"prompt": "x", "stream": "yes"}, 400, "stream"),
    ({"prompt": "x", "stream": True, "partial_images": 4}, 400, "partial_images"),
    ({"prompt": "x", "frame_count": 4}, 400, "frame_count"),
    ({"prompt": "x", "model": "dall-e-3"}, 404, "model"),
    ("[" * 100_000 + "]" * 100_000, 400, None),
    ({"prompt": "x" * (1 << 20)}, 413, None),
]


@pytest.mark.parametrize("body,status,param", INVALID, ids=[f"{i}-{p}" for i, (_, _, p) in enumerate(INVALID)])
def test_invalid_input_is_an_openai_error(server, body, status, param):
    content = body if isinstance(body, str) else json.dumps(body)
    resp = httpx.post(f"{server.base}/v1/images/generations", content=content,
                      headers={"content-type": "application/json"})
    assert_openai_error(resp, status, param)
    assert not server.engine.engine.has_unfinished_requests()


STREAM_INVALID = [
    ({"size": "abc"}, 400, "size"),
    ({"size": "1024x1024"}, 400, "size"),
    ({"n": 11}, 400, "n"),
    ({"num_inference_steps": 10**6}, 400, "num_inference_steps"),
    ({"seed": 2**63, "n": 2}, 400, "seed"),
    ({"model": "dall-e-3"}, 404, "model"),
]


@pytest.mark.parametrize("extra,status,param", STREAM_INVALID, ids=[p for _, _, p in STREAM_INVALID])
def test_invalid_streaming_request_is_a_json_error(server, extra, status, param):
    """Validation happens before the event stream starts: an error, not a 200 stream."""
    resp = httpx.post(f"{server.base}/v1/images/generations",
                      json={"prompt": "x", "stream": True, "partial_images": 1, **extra})
    assert_openai_error(resp, status, param)
    assert resp.headers["content-type"] == "application/json"
    assert not server.engine.engine.has_unfinished_requests()


def test_size_over_model_maximum_names_the_limit(server):
    resp = httpx.post(f"{server.base}/v1/images/generations", json={"prompt": "x", "size": "1024x1024"})
    assert_openai_error(resp, 400, "size")
    assert "512" in resp.json()["error"]["message"]
    assert server.client.images.generate(prompt="x", size="512x64", extra_body=FAST).data[0].b64_json


def test_server_healthy_after_invalid_inputs(server):
    assert httpx.get(f"{server.base}/health").status_code == 200
    assert server.client.images.generate(prompt="still fine", extra_body=FAST).data[0].b64_json
    with pytest.raises(openai.BadRequestError) as info:
        server.client.images.generate(prompt="x", size="abc")
    assert info.value.body["param"] == "size"
    models = server.client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert_openai_error(httpx.get(f"{server.base}/v1/models/other"), 404, "model")


def test_queue_room_is_checked_for_all_n_before_queueing(tiny_sd3_dir, monkeypatch):
    # One CFG request fills a batch (2 rows); the waiting queue holds two more.
    engine = new_engine(tiny_sd3_dir, max_batch_size=2, max_waiting_requests=2)
    app = create_app(engine, MODEL)

    def count(base, name, **labels):
        return scrape(base).get((name, tuple(sorted(labels.items()))), 0)

    with serve(app) as base:
        url = f"{base}/v1/images/generations"
        # n above the queue bound could never be queued: 400 naming the range, not a 429.
        resp = httpx.post(url, json={"prompt": "7", "n": 3})
        assert_openai_error(resp, 400, "n")
        assert "[1, 2]" in resp.json()["error"]["message"]
        assert_openai_error(httpx.post(url, json={"prompt": "7", "n": 11}), 400, "n")
        long = {"prompt": "slow", "num_inference_steps": LONG_STEPS, "stream": True}
        with httpx.stream("POST", url, json=long, timeout=30) as running, \
                httpx.stream("POST", url, json=long, timeout=30) as waiting:
            assert running.status_code == waiting.status_code == 200
            wait_until(lambda: engine.engine.num_waiting == 1 and engine.num_running == 1,
                       what="one running, one waiting")
            # Room for 1, n=2 needs 2: a 429 (a JSON error, also when streaming), nothing queued.
            resp = httpx.post(url, json={"prompt": "x", "n": 2, "stream": True, **FAST})
            assert_openai_error(resp, 429)
            assert resp.headers["content-type"] == "application/json"
            assert resp.headers["retry-after"] == "1" and resp.json()["error"]["type"] == "rate_limit_error"
            assert engine.engine.num_waiting == 1
            # The free slot is held for the refused request (first refused, first served): a new
            # one-image request is refused too while its client may still retry ...
            assert_openai_error(httpx.post(url, json={"prompt": "y", **FAST}), 429)
            # ... and is free again once the refused request's client gave up (its hold lapsed).
            line = app.state.diffserve.images.admission
            monkeypatch.setattr(line, "_clock", lambda: time.monotonic() + 60)
            with httpx.stream("POST", url, json=long, timeout=30) as third:
                assert third.status_code == 200
                wait_until(lambda: engine.engine.num_waiting == 2, what="third queued")
            wait_until(lambda: engine.engine.num_waiting == 1, timeout=5, what="third aborted")
            # Were the room taken between the check and the queueing anyway (a race the check
            # prevents), the queued part is aborted, and the answer is a 429 all the same.
            monkeypatch.setattr(app.state.diffserve.images, "check_queue_room", lambda n, fingerprint: None)
            assert_openai_error(httpx.post(url, json={"prompt": "x", "n": 2, **FAST}), 429)
            wait_until(lambda: engine.engine.num_waiting == 1, timeout=5, what="rejected part dropped")
            monkeypatch.undo()
        wait_until(lambda: not engine.engine.has_unfinished_requests(), timeout=5, what="abort")
        wait_until(lambda: count(base, "diffserve_requests_total", status="499") == 3, timeout=5,
                   what="499 counted")
        assert count(base, "diffserve_requests_total", status="429") == 3
        # Aborted: the three streams. The rejected requests are no engine requests.
        assert count(base, "diffserve_engine_requests_total", outcome="aborted") == 3
        assert sum(v for (name, _), v in scrape(base).items() if name == "diffserve_engine_requests_total") == 3
        assert httpx.post(url, json={"prompt": "x", **FAST}).status_code == 200


def test_concurrent_groups_cannot_overfill_the_queue(tiny_sd3_dir):
    """Two n=2 requests checked one right after the other on the event loop, with room for 3:
    the second sees the first's room reserved (its requests are not queued yet) and gets the
    429 before queueing anything, instead of leaving a partial group."""
    engine = new_engine(tiny_sd3_dir, max_batch_size=2, max_waiting_requests=3)
    metrics = ServerMetrics()
    service = ImageGenerationService(engine, MODEL, ImageStore(60, 10), metrics, lambda: False)

    def group(**body):
        return service._group(service._plan(ImageGenerationRequest(**body)))

    async def main():
        blocker = group(prompt="slow", num_inference_steps=LONG_STEPS)
        await service._submit(blocker, 1)
        while engine.num_running != 1:  # fills the batch: the rest waits
            await asyncio.sleep(0.01)
        first, second = group(prompt="x", n=2, **FAST), group(prompt="y", n=2, **FAST)
        results = await asyncio.gather(service._submit(first, 2), service._submit(second, 2),
                                       return_exceptions=True)
        assert results[0] is None and isinstance(results[1], EngineOverloadedError), results
        assert engine.engine.num_waiting == 2 and service._reserved == 0
        for g in (blocker, first):
            g.abort()
            await g.close()

    engine.start()
    try:
        asyncio.run(main())
    finally:
        engine.shutdown(5)


def test_client_disconnect_aborts_and_leaves_no_trace(server, tiny_sd3_dir):
    before = scrape(server.base)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.base}/v1/images/generations",
                   json={"prompt": "a long one", "num_inference_steps": LONG_STEPS, "seed": 5}, timeout=0.3)
    wait_until(lambda: not server.engine.engine.has_unfinished_requests(), timeout=5, what="abort")
    key499 = ("diffserve_requests_total", (("status", "499"),))
    wait_until(lambda: scrape(server.base).get(key499, 0) > before.get(key499, 0), timeout=5, what="499 counted")
    aborted = ("diffserve_engine_requests_total", (("outcome", "aborted"),))
    # the handler counts the abort after the 499, on its way out: wait for it too
    wait_until(lambda: scrape(server.base)[aborted] > before[aborted], timeout=5, what="abort counted")
    after = scrape(server.base)
    assert after[aborted] - before[aborted] == 1
    assert after.get(("diffserve_requests_total", (("status", "499"),)), 0) \
        - before.get(("diffserve_requests_total", (("status", "499"),)), 0) == 1
    body = {"prompt": "after the abort", "num_inference_steps": 3, "seed": 77}
    image = decode(httpx.post(f"{server.base}/v1/images/generations", json=body).json()["data"][0]["b64_json"])
    with serve(create_app(new_engine(tiny_sd3_dir), MODEL)) as fresh:
        reference = decode(httpx.post(f"{fresh}/v1/images/generations", json=body).json()["data"][0]["b64_json"])
    assert np.array_equal(image, reference)


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


def test_disconnect_while_sending_body_is_499_without_traceback(server):
    handler = _Records()
    loggers = [logging.getLogger(name) for name in ("uvicorn.error", "diffserve")]
    ours = logging.getLogger("diffserve.entrypoints.openai")
    level = ours.level
    ours.setLevel(logging.INFO)
    for logger in loggers:
        logger.addHandler(handler)
    key499 = ("diffserve_requests_total", (("status", "499"),))
    key500 = ("diffserve_requests_total", (("status", "500"),))
    before = scrape(server.base)
    try:
        host, port = server.base.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as conn:
            conn.sendall(b"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\n"
                         b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
                         b'{"prompt": "half a bo')
            time.sleep(0.1)
        wait_until(lambda: scrape(server.base).get(key499, 0) == before.get(key499, 0) + 1, timeout=5,
                   what="499 counted")
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
        ours.setLevel(level)
    assert scrape(server.base).get(key500, 0) == before.get(key500, 0)
    assert not [r for r in handler.records if r.exc_info or r.levelno >= logging.WARNING], handler.records
    lines = [r.getMessage() for r in handler.records if "disconnected" in r.getMessage()]
    assert len(lines) == 1 and re.fullmatch(r'127\.0\.0\.1:\d+ - "POST /v1/images/generations" 499 client '
                                            r'disconnected while sending the request body', lines[0]), lines
    assert httpx.get(f"{server.base}/health").status_code == 200


# -------------------------------------------------------------------- health, metrics
def test_health_503_while_loading(tiny_sd3_dir):
    release = threading.Event()

    def loader():
        release.wait(10)
        return new_engine(tiny_sd3_dir)

    with serve(create_app(None, MODEL, engine_loader=loader)) as base:
        assert_openai_error(httpx.get(f"{base}/health"), 503)
        assert_openai_error(httpx.post(f"{base}/v1/images/generations", json={"prompt": "x"}), 503)
        assert httpx.get(f"{base}/v1/models").json()["data"][0]["id"] == MODEL
        release.set()
        wait_until(lambda: httpx.get(f"{base}/health").status_code == 200, what="model load")


def test_metrics_parse_and_move(server):
    before = scrape(server.base)
    server.client.images.generate(prompt="count me", extra_body={"num_inference_steps": 3})
    after = scrape(server.base)

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after[key] - before.get(key, 0.0)

    assert delta("diffserve_requests_total", status="200") == 1
    assert delta("diffserve_images_generated_total") == 1
    assert delta("diffserve_engine_requests_total", outcome="finished") == 1
    for stage in ("queue", "encode", "denoise", "decode", "total"):
        assert delta("diffserve_request_stage_seconds_count", stage=stage) == 1
    assert delta("diffserve_step_duration_seconds_count") == 3
    assert delta("diffserve_step_batch_rows_sum") == 6  # 3 steps x 2 CFG rows
    for gauge in ("diffserve_num_requests_waiting", "diffserve_num_requests_running", "diffserve_num_running_rows"):
        assert after[(gauge, ())] == 0
    # acceleration counters: a new prompt misses the prompt-embedding cache (the empty negative
    # prompt may already be cached), the same request again hits for both texts
    assert delta("diffserve_prompt_embed_cache_misses_total") >= 1
    server.client.images.generate(prompt="count me", extra_body={"num_inference_steps": 3})
    again = scrape(server.base)
    assert again[("diffserve_prompt_embed_cache_hits_total", ())] - after[("diffserve_prompt_embed_cache_hits_total", ())] == 2
    assert again[("diffserve_prompt_embed_cache_misses_total", ())] == after[("diffserve_prompt_embed_cache_misses_total", ())]
    assert again[("diffserve_prompt_embed_cache_entries", ())] >= 1


# ---------------------------------------------------------------------------- shutdown
def test_shutdown_stops_admitting_and_aborts_after_timeout(tiny_sd3_dir):
    app = create_app(new_engine(tiny_sd3_dir), MODEL, shutdown_timeout_s=0.3)
    with serve(app) as base:
        long = {"prompt": "slow", "num_inference_steps": LONG_STEPS, "stream": True, "partial_images": 0}
        with httpx.stream("POST", f"{base}/v1/images/generations", json=long, timeout=30) as stream:
            assert stream.status_code == 200
            app.state.diffserve.begin_shutdown()
            assert_openai_error(httpx.get(f"{base}/health"), 503)
            assert_openai_error(httpx.post(f"{base}/v1/images/generations", json={"prompt": "x"}), 503)
            lines = [line for line in stream.iter_lines() if line.startswith("data: ")]
        error = json.loads(lines[-1][len("data: "):])
        assert error["type"] == "error" and error["error"]["code"] == "shutting_down"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("where", ["port in use", "bad host"])
def test_serve_cannot_listen_is_one_error_line_and_exit_2(where, capsys, caplog):
    from diffserve.entrypoints.cli_args import EXIT_USAGE, build_parser
    from diffserve.entrypoints.openai.server import run_server

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        host, port = ("127.0.0.1", taken.getsockname()[1]) if where == "port in use" else ("999.1.1.1", 8000)
        # A model folder that does not exist: loading it would fail differently.
        args = build_parser().parse_args(["serve", "--host", host, "--port", str(port), "--log-level", "info",
                                          "--model", "/nonexistent/model"])
        level = logging.getLogger("diffserve").level
        try:
            with caplog.at_level(logging.INFO, logger="diffserve"):
                assert run_server(args) == EXIT_USAGE
        finally:
            logging.getLogger("diffserve").setLevel(level)
    err = capsys.readouterr().err
    assert err.startswith(f"diffserve: error: cannot listen on {host}:{port}: ") and err.count("\n") == 1, err
    if where == "port in use":
        assert "Address already in use" in err
    else:  # the resolver's reason ("Name or service not known", ...)
        assert len(err.strip()) > len(f"diffserve: error: cannot listen on {host}:{port}: ")
    assert not [r for r in caplog.records if "serving" in r.getMessage()]


def test_sigterm_finishes_in_flight_request_and_exits_0(tiny_sd3_dir):
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "diffserve", "serve", "--model", str(tiny_sd3_dir), "--port", str(port),
         "--threads", "1", "--shutdown-timeout", "30", "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    base = f"http://127.0.0.1:{port}"
    try:
        def healthy():
            assert proc.poll() is None, proc.communicate()[1]
            try:
                return httpx.get(f"{base}/health").status_code == 200
            except httpx.TransportError:
                return False

        wait_until(healthy, timeout=180, what="server start")  # a loaded 2-core CI machine
        body = {"prompt": "finish me", "num_inference_steps": 100, "stream": True,
                "model": os.path.basename(os.path.realpath(tiny_sd3_dir))}
        with httpx.stream("POST", f"{base}/v1/images/generations", json=body, timeout=30) as stream:
            assert stream.status_code == 200
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.2)
            try:  # no longer admitting: the listener is closed (or, racing it, a 503)
                assert httpx.get(f"{base}/health").status_code == 503
            except httpx.TransportError:
                pass
            events = [line for line in stream.iter_lines() if line.startswith("event: ")]
        assert events == ["event: image_generation.completed"]
        assert proc.wait(timeout=30) == 0
        assert "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
