"""Hardening of the HTTP server, run for real (uvicorn with diffserve's protocol on localhost,
raw sockets and the official `openai` client): control characters, engine death, slow and
idle connections, url image promises, SSE keep-alive, half-closed clients, API keys,
content types, CORS and link origins."""

from __future__ import annotations

import base64
import io
import json
import logging
import select
import socket
import threading
import time

import httpx
import openai
import pytest
import torch
from PIL import Image

from diffserve import AsyncDiffusionEngine, EngineConfig
from diffserve.entrypoints.cli_args import build_parser
from diffserve.entrypoints.openai.app import create_app
from diffserve.entrypoints.openai import http_protocol
from diffserve.entrypoints.openai.http_protocol import ConnectionLimits, RateLimitedLogger
from diffserve.entrypoints.openai.stores.image_store import ImageStore, StoreFullError
from diffserve.entrypoints.server_args import check_server_arguments
from diffserve.core.errors import InvalidRequestError
from server_helpers import assert_openai_error, serve, wait_until

torch.set_num_threads(1)

LONG_STEPS = 20_000
FAST = {"num_inference_steps": 2}


def new_engine(model_dir, **overrides) -> AsyncDiffusionEngine:
    overrides.setdefault("max_num_inference_steps", LONG_STEPS)
    return AsyncDiffusionEngine(EngineConfig(model=str(model_dir), num_threads=1, **overrides))


@pytest.fixture(scope="module")
def engine(tiny_sd3_dir):
    return new_engine(tiny_sd3_dir)


def _host_port(base: str) -> tuple[str, int]:
    host, port = base.removeprefix("http://").split(":")
    return host, int(port)


def _read_until_closed(conn: socket.socket, timeout: float = 10.0) -> bytes:
    """Everything the server sends until it closes the connection (fails after `timeout` s)."""
    conn.settimeout(timeout)
    chunks = []
    while True:
        chunk = conn.recv(65536)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def _post_bytes(body: dict, extra_headers: str = "") -> bytes:
    payload = json.dumps(body).encode()
    return (f"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n{extra_headers}\r\n").encode() + payload


def _json_of(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(body)


# ------------------------------------------------------------------ 3: control characters
@pytest.mark.parametrize("body,param", [
    ({"prompt": "a digit 7\u0000 seven"}, "prompt"),
    ({"prompt": "\x1b[31mred"}, "prompt"),
    ({"prompt": "x\u0085y"}, "prompt"),  # a C1 control character
    ({"prompt": "a cat", "negative_prompt": "blurry\x00"}, "negative_prompt"),
])
def test_control_characters_are_400_naming_the_field(engine, body, param):
    with serve(create_app(engine, "m")) as base:
        resp = httpx.post(f"{base}/v1/images/generations", json={**body, **FAST})
        assert_openai_error(resp, 400, param, code="invalid_value")
        assert "control characters" in resp.json()["error"]["message"]
        # ordinary whitespace is fine
        ok = httpx.post(f"{base}/v1/images/generations", json={"prompt": "a\tcat\r\non a mat", **FAST})
        assert ok.status_code == 200, ok.text


# ---------------------------------------------------------------------- 5: engine death
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_dead_engine_loop_is_503_on_health_and_requests_fail_fast(tiny_sd3_dir):
    engine = new_engine(tiny_sd3_dir)
    with serve(create_app(engine, "m")) as base:
        url = f"{base}/v1/images/generations"
        assert httpx.get(f"{base}/health").status_code == 200
        results = {}

        def waiting_request():  # in flight when the loop dies
            try:
                results["json"] = httpx.post(url, json={"prompt": "x", "num_inference_steps": LONG_STEPS},
                                             timeout=30)
            except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
                results["json"] = exc

        with httpx.stream("POST", url, json={"prompt": "y", "num_inference_steps": LONG_STEPS, "stream": True},
                          timeout=30) as stream:
            thread = threading.Thread(target=waiting_request)
            thread.start()
            wait_until(lambda: engine.num_running + engine.engine.num_waiting == 2,
                       what="both requests in the engine")

            def die():
                raise SystemExit("simulated engine loop death")

            engine.engine.step = die  # the loop thread exits at its next step (SystemExit is not caught)
            wait_until(lambda: not engine.is_running, what="engine loop death")
            lines = [line for line in stream.iter_lines() if line.startswith("data: ")]
        error = json.loads(lines[-1][len("data: "):])
        assert error["type"] == "error" and error["error"]["code"] == "engine_dead"
        thread.join(timeout=30)
        assert not thread.is_alive()
        assert isinstance(results["json"], httpx.Response), results
        assert_openai_error(results["json"], 503, code="engine_dead")
        health = httpx.get(f"{base}/health", timeout=5)
        assert_openai_error(health, 503, code="engine_dead")
        assert "engine" in health.json()["error"]["message"]
        assert_openai_error(httpx.post(url, json={"prompt": "z", **FAST}, timeout=5), 503, code="engine_dead")
        assert not engine.is_running  # a new request must not restart the dead loop
    engine.engine.step = lambda: []


# ------------------------------------------------------------- 6: slow / idle connections
def test_idle_and_half_sent_requests_are_closed_after_the_timeouts(engine):
    limits = ConnectionLimits(max_connections=64, header_timeout_s=0.5, body_timeout_s=0.5)
    with serve(create_app(engine, "m"), limits=limits) as base:
        address = _host_port(base)
        idle = socket.create_connection(address)
        half_headers = socket.create_connection(address)
        half_headers.sendall(b"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nContent-Ty")
        half_body = socket.create_connection(address)
        half_body.sendall(b"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: 100\r\n\r\n{\"prompt\": ")
        trickle = socket.create_connection(address)
        trickle.sendall(b"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                        b"Content-Length: 100\r\n\r\n")
        assert httpx.get(f"{base}/health").status_code == 200  # the server keeps answering
        answered_while_trickling = False
        for _ in range(60):  # a byte every 0.05 s (3 s in all) does not extend the 0.5 s body deadline
            if select.select([trickle], [], [], 0)[0]:
                answered_while_trickling = True
                break
            try:
                trickle.sendall(b" ")
            except OSError:
                answered_while_trickling = True
                break
            time.sleep(0.05)
        assert answered_while_trickling
        with idle, half_headers, half_body, trickle:
            assert _read_until_closed(idle) == b""  # nothing sent, closed silently
            for conn, what in ((half_headers, "headers"), (half_body, "body"), (trickle, "body")):
                status, body = _json_of(_read_until_closed(conn))
                assert status == 408 and body["error"]["code"] == "request_timeout"
                assert f"request {what} not received within 0.5s" in body["error"]["message"]
        # a kept-alive connection's next request has the same header deadline
        with httpx.Client() as client:
            assert client.get(f"{base}/health").status_code == 200
        assert httpx.get(f"{base}/health").status_code == 200
        metrics = httpx.get(f"{base}/metrics").text
        assert 'diffserve_requests_total{status="408"} 2.0' in metrics  # the two body timeouts


def test_connection_limit_refuses_with_503_and_logs_bounded(engine):
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    log = logging.getLogger("diffserve.entrypoints.openai.http_protocol")
    log.addHandler(handler)
    old_level = log.level
    log.setLevel(logging.INFO)
    limits = ConnectionLimits(max_connections=4, header_timeout_s=30)
    http_protocol.connection_log.reset()
    try:
        with serve(create_app(engine, "m"), limits=limits) as base:
            address = _host_port(base)
            held = [socket.create_connection(address) for _ in range(4)]
            try:
                wait_until(lambda: _refused(address), what="the limit reached")
                for _ in range(20):
                    assert _refused(address)
            finally:
                for conn in held:
                    conn.close()
            wait_until(lambda: _health_ok(base), what="room again after closing connections")
    finally:
        log.removeHandler(handler)
        log.setLevel(old_level)
    refused = [r for r in records if "refused a connection" in r.getMessage()]
    assert 1 <= len(refused) <= 2, [r.getMessage() for r in records]  # 21+ refusals, rate-limited lines
    assert not [r for r in records if r.exc_info]


def test_invalid_requests_flood_logs_bounded(engine):
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    log = logging.getLogger("uvicorn.error")
    try:
        with serve(create_app(engine, "m")) as base:
            log.addHandler(handler)  # after uvicorn configured its loggers
            http_protocol._uvicorn_log.reset()
            for _ in range(30):
                with socket.create_connection(_host_port(base)) as conn:
                    conn.sendall(b"NOT HTTP AT ALL\r\n\r\n")
                    assert _read_until_closed(conn).startswith(b"HTTP/1.1 400")
            assert httpx.get(f"{base}/health").status_code == 200
    finally:
        log.removeHandler(handler)
    invalid = [r for r in records if "Invalid HTTP request" in r.getMessage()]
    assert 1 <= len(invalid) <= 2, [r.getMessage() for r in records]
    assert not [r for r in records if r.exc_info]


def _refused(address) -> bool:
    with socket.create_connection(address) as conn:
        conn.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        raw = _read_until_closed(conn)
    if not raw.startswith(b"HTTP/1.1 503"):
        return False
    status, body = _json_of(raw)
    return body["error"]["code"] == "too_many_connections" and b"retry-after: 1" in raw.lower()


def _health_ok(base: str) -> bool:
    try:
        return httpx.get(f"{base}/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def test_rate_limited_logger_reports_suppressed_count():
    records: list[logging.LogRecord] = []
    log = logging.getLogger("test.ratelimited")
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    limited = RateLimitedLogger(log, interval_s=0.2)
    for i in range(50):
        limited.info("closed %s", i)
    time.sleep(0.25)
    limited.info("closed %s", 99)
    assert [r.getMessage() for r in records] == ["closed 0", "closed 99 (and 49 more like it in the last 0.2s)"]


# --------------------------------------------------------------------------- 9: url images
def test_image_store_keeps_every_promise_and_refuses_when_full(tmp_path):
    now = [0.0]
    store = ImageStore(ttl_s=10, max_images=3, max_memory_bytes=100, spill_dir=tmp_path / "spill",
                       max_spill_bytes=200, clock=lambda: now[0])
    first = store.reserve(2, 120)
    names = [store.put(b"a" * 60, "image/png", "png", first)[0], store.put(b"b" * 50, "image/png", "png", first)[0]]
    first.release()
    assert store.stats()["reserved_bytes"] == 0 and store.stats()["spilled_bytes"] == 60  # oldest spilled
    assert len(list((tmp_path / "spill").rglob("*.png"))) == 1
    now[0] = 4.0
    second = store.reserve(1, 100)
    name3, ttl = store.put(b"c" * 100, "image/png", "png", second)
    assert ttl == 10
    with pytest.raises(StoreFullError) as info:  # 3 images: full until the first expires at t=10
        store.reserve(1, 10)
    assert info.value.retry_after_s == 6
    with pytest.raises(InvalidRequestError) as never:
        store.reserve(1, 10_000)  # larger than the store: never fits, retrying cannot help
    assert never.value.field == "response_format"
    with pytest.raises(InvalidRequestError) as never:
        store.reserve(4, 40)  # more images than the store holds
    assert never.value.field == "n" and "at most 3" in str(never.value)
    for name, data in zip([*names, name3], (b"a" * 60, b"b" * 50, b"c" * 100)):
        assert store.get(name).data == data  # every image is still there, from memory or disk
    now[0] = 10.0
    assert store.get(names[0]) is None and store.get(names[1]) is None and store.get(name3) is not None
    assert not list((tmp_path / "spill").rglob("*.png")) or store.stats()["spilled_bytes"] > 0
    store.reserve(2, 50).release()  # room again
    store.close()
    assert not (tmp_path / "spill").exists()


def test_url_responses_never_promise_what_eviction_breaks(engine):
    app = create_app(engine, "m", max_stored_images=2, image_url_ttl_s=120)
    with serve(app) as base:
        url = f"{base}/v1/images/generations"
        resp = httpx.post(url, json={"prompt": "x", "n": 2, "response_format": "url", **FAST})
        assert resp.status_code == 200, resp.text
        data = resp.json()["data"]
        assert all(time.time() + 100 < d["expires_at"] <= time.time() + 120 for d in data)
        full = httpx.post(url, json={"prompt": "y", "response_format": "url", **FAST})
        assert_openai_error(full, 503, code="image_store_full")
        assert 100 <= int(full.headers["retry-after"]) <= 120
        assert "b64_json" in full.json()["error"]["message"]
        assert not engine.engine.has_unfinished_requests()  # refused before anything was queued
        for d in data:  # the promised links keep working
            assert httpx.get(d["url"]).status_code == 200
        assert httpx.post(url, json={"prompt": "y", **FAST}).status_code == 200  # b64_json still served
        never = httpx.post(url, json={"prompt": "z", "n": 3, "response_format": "url", **FAST})
        assert_openai_error(never, 400, param="n")  # more than the store holds: not a 503 to retry
        assert "retry-after" not in never.headers


# --------------------------------------------------------------------- 10: SSE keep-alive
def test_quiet_event_stream_gets_keep_alive_comments(engine):
    with serve(create_app(engine, "m", sse_heartbeat_s=0.1)) as base:
        body = {"prompt": "slow", "num_inference_steps": LONG_STEPS, "stream": True}
        with httpx.stream("POST", f"{base}/v1/images/generations", json=body, timeout=30) as stream:
            assert stream.headers["content-type"].startswith("text/event-stream")
            lines = []
            for line in stream.iter_lines():
                lines.append(line)
                if lines.count(": keep-alive") >= 3:
                    break
        assert set(lines) <= {": keep-alive", ""}, lines
        wait_until(lambda: not engine.engine.has_unfinished_requests(), what="abort after the client left")
        # the official client ignores the comments
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
        events = list(client.images.generate(prompt="a tree", stream=True, partial_images=1,
                                             extra_body={"num_inference_steps": 4, "seed": 1}))
        assert [e.type for e in events] == ["image_generation.partial_image", "image_generation.completed"]


# ---------------------------------------------------------------- 11: half-closed clients
@pytest.mark.parametrize("stream", [False, True])
def test_half_closed_client_gets_its_full_response(engine, stream):
    with serve(create_app(engine, "m")) as base:
        with socket.create_connection(_host_port(base)) as conn:
            conn.sendall(_post_bytes({"prompt": "a cat", "num_inference_steps": 30, "seed": 4, "stream": stream}))
            conn.shutdown(socket.SHUT_WR)  # done sending; still reading
            raw = _read_until_closed(conn, timeout=60)
        interim = b"HTTP/1.1 100 Continue\r\n\r\n"
        probes = 0
        while raw.startswith(interim):  # the server's probes of the half-closed connection
            raw, probes = raw[len(interim):], probes + 1
        assert probes <= 2 and raw.startswith(b"HTTP/1.1 200"), raw[:200]
        if stream:
            assert b"event: image_generation.completed" in raw
        else:
            status, payload = _json_of(raw)
            image = Image.open(io.BytesIO(base64.b64decode(payload["data"][0]["b64_json"])))
            assert image.size == (64, 64) and payload["data"][0]["seed"] == 4
        metrics = httpx.get(f"{base}/metrics").text
        assert 'diffserve_requests_total{status="499"}' not in metrics


def test_client_gone_after_sending_is_detected_and_aborted(engine):
    """A client that closes (not half-closes) after its request looks the same to TCP until the
    server writes: the probes find out and the request is aborted."""
    with serve(create_app(engine, "m")) as base:
        for stream in (False, True):
            conn = socket.create_connection(_host_port(base))
            conn.sendall(_post_bytes({"prompt": "gone", "num_inference_steps": LONG_STEPS, "stream": stream}))
            wait_until(lambda: engine.engine.has_unfinished_requests(), what="request running")
            conn.close()
            wait_until(lambda: not engine.engine.has_unfinished_requests(), timeout=5, what="abort")


def test_half_close_mid_body_is_a_disconnect(engine):
    with serve(create_app(engine, "m")) as base:
        with socket.create_connection(_host_port(base)) as conn:
            conn.sendall(b"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{\"prompt\"")
            conn.shutdown(socket.SHUT_WR)
            assert _read_until_closed(conn) == b""
        wait_until(lambda: 'diffserve_requests_total{status="499"} 1.0' in httpx.get(f"{base}/metrics").text,
                   what="499 counted")


# ----------------------------------------------------------------------- 12: API key
def test_api_key_protects_v1_with_openai_errors(engine):
    with serve(create_app(engine, "m", api_key="sk-test-123")) as base:
        good = openai.OpenAI(base_url=f"{base}/v1", api_key="sk-test-123", max_retries=0)
        resp = good.images.generate(prompt="a cat", response_format="url", extra_body=FAST)
        assert httpx.get(resp.data[0].url).status_code == 200  # links are capabilities: no key needed
        assert [m.id for m in good.models.list().data] == ["m"]
        bad = openai.OpenAI(base_url=f"{base}/v1", api_key="sk-wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as info:
            bad.images.generate(prompt="a cat", extra_body=FAST)
        assert info.value.status_code == 401 and info.value.body["code"] == "invalid_api_key"
        for path in ("/v1/models", "/v1/images/generations"):
            resp = httpx.request("GET" if "models" in path else "POST", f"{base}{path}", json={"prompt": "x"})
            assert_openai_error(resp, 401, code="invalid_api_key")
            assert resp.headers["www-authenticate"] == "Bearer"
        assert httpx.get(f"{base}/health").status_code == 200
        assert httpx.get(f"{base}/metrics").status_code == 200
        assert not engine.engine.has_unfinished_requests()
    with serve(create_app(engine, "m", api_key="sk-test-123", api_key_protect_all=True)) as base:
        for path in ("/health", "/metrics", "/openapi.json"):
            assert_openai_error(httpx.get(f"{base}{path}"), 401, code="invalid_api_key")
            assert httpx.get(f"{base}{path}", headers={"Authorization": "Bearer sk-test-123"}).status_code == 200


def test_api_key_from_environment_and_checks(monkeypatch):
    parser = build_parser()
    monkeypatch.setenv("DIFFSERVE_API_KEY", "from-env")
    args = parser.parse_args(["serve"])
    check_server_arguments(args)
    assert args.api_key == "from-env"
    args = parser.parse_args(["serve", "--api-key", "flag-wins"])
    check_server_arguments(args)
    assert args.api_key == "flag-wins"
    monkeypatch.delenv("DIFFSERVE_API_KEY")
    args = parser.parse_args(["serve", "--api-key-protect-all"])
    with pytest.raises(InvalidRequestError, match="api_key_protect_all"):
        check_server_arguments(args)
    for argv, field in ((["--max-connections", "0"], "max_connections"), (["--header-timeout", "0"], "header_timeout"),
                        (["--public-url", "ftp://x"], "public_url"), (["--sse-heartbeat", "-1"], "sse_heartbeat")):
        with pytest.raises(InvalidRequestError) as info:
            check_server_arguments(parser.parse_args(["serve", *argv]))
        assert info.value.field == field


# ------------------------------------------------------- 13: content type, CORS, link origin
@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", None])
def test_json_route_requires_application_json(engine, content_type):
    with serve(create_app(engine, "m")) as base:
        headers = {} if content_type is None else {"Content-Type": content_type}
        resp = httpx.post(f"{base}/v1/images/generations", content=json.dumps({"prompt": "x", **FAST}),
                          headers=headers)
        assert_openai_error(resp, 415, code="unsupported_media_type")
        assert not engine.engine.has_unfinished_requests()
        ok = httpx.post(f"{base}/v1/images/generations", content=json.dumps({"prompt": "x", **FAST}),
                        headers={"Content-Type": "application/json; charset=utf-8"})
        assert ok.status_code == 200


def test_cors_only_for_allowed_origins(engine):
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    with serve(create_app(engine, "m")) as base:
        resp = httpx.options(f"{base}/v1/images/generations", headers=preflight)
        assert "access-control-allow-origin" not in resp.headers
        resp = httpx.get(f"{base}/v1/models", headers={"Origin": "https://app.example"})
        assert "access-control-allow-origin" not in resp.headers
    with serve(create_app(engine, "m", api_key="k", allowed_origins=["https://app.example"])) as base:
        resp = httpx.options(f"{base}/v1/images/generations", headers=preflight)
        assert resp.status_code == 200 and resp.headers["access-control-allow-origin"] == "https://app.example"
        resp = httpx.options(f"{base}/v1/images/generations", headers={**preflight, "Origin": "https://evil.example"})
        assert resp.headers.get("access-control-allow-origin") != "https://evil.example"
        resp = httpx.get(f"{base}/v1/models", headers={"Origin": "https://app.example", "Authorization": "Bearer k"})
        assert resp.status_code == 200 and resp.headers["access-control-allow-origin"] == "https://app.example"


def test_url_links_ignore_client_host_headers(engine):
    spoof = {"Host": "evil.example", "X-Forwarded-Host": "evil.example", "X-Forwarded-Proto": "https",
             "Forwarded": "host=evil.example"}
    body = {"prompt": "x", "response_format": "url", **FAST}
    with serve(create_app(engine, "m")) as base:
        link = httpx.post(f"{base}/v1/images/generations", json=body, headers=spoof).json()["data"][0]["url"]
        assert link.startswith(f"{base}/v1/images/files/") and httpx.get(link).status_code == 200
    with serve(create_app(engine, "m", public_url="https://images.example.com/gen/")) as base:
        link = httpx.post(f"{base}/v1/images/generations", json=body, headers=spoof).json()["data"][0]["url"]
        assert link.startswith("https://images.example.com/gen/v1/images/files/")
        assert httpx.get(base + link.removeprefix("https://images.example.com/gen")).status_code == 200


# ------------------------------------------------------------------- 14: OpenAPI schema
def test_openapi_states_the_enforced_limits_and_content_types(engine):
    import re

    with serve(create_app(engine, "m")) as base:
        spec = httpx.get(f"{base}/openapi.json").json()
        post = spec["paths"]["/v1/images/generations"]["post"]
        body = post["requestBody"]["content"]["application/json"]["schema"]["properties"]

        def branch(prop):
            return next(b for b in prop.get("anyOf", [prop]) if b.get("type") != "null")

        assert body["prompt"]["minLength"] == 1 and body["prompt"]["maxLength"] == 32000
        prompt_re = re.compile(body["prompt"]["pattern"])
        assert prompt_re.search("a cat\tsitting\n") and not prompt_re.search("   ")
        assert not prompt_re.search("a\x00b") and not prompt_re.search("\x1b[31m")
        assert branch(body["n"])["minimum"] == 1 and branch(body["n"])["maximum"] == 10
        assert branch(body["num_inference_steps"]) == {"type": "integer", "minimum": 1, "maximum": LONG_STEPS}
        assert branch(body["guidance_scale"])["maximum"] == 100
        size_re = re.compile(branch(body["size"])["pattern"])  # the tiny model: multiples of 16 up to 512
        for size, ok in (("auto", True), ("16x512", True), ("64X48", True), ("65x64", False), ("528x16", False),
                         ("0x16", False), ("abc", False)):
            assert bool(size_re.search(size)) is ok, size
        assert body["svg"]["type"] == "null" and branch(body["background"])["enum"] == ["auto", "opaque"]
        content = post["responses"]["200"]["content"]
        assert set(content) == {"application/json", "text/event-stream"}
        assert content["text/event-stream"]["schema"]["properties"]["event"]["enum"] == [
            "image_generation.partial_image", "image_generation.completed", "diffserve.queued", "diffserve.progress",
            "error"]
        assert {"400", "404", "408", "413", "415", "429", "500", "503"} <= set(post["responses"])
        assert "401" not in post["responses"]  # no --api-key: nothing answers 401
        keyed = create_app(engine, "m", api_key="k").openapi()["paths"]["/v1/images/generations"]["post"]
        assert "401" in keyed["responses"]
        assert set(spec["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
        assert httpx.get(f"{base}/metrics").headers["content-type"].startswith("text/plain")
        # what the schema allows is accepted: integral numbers are integers, seeds wrap around
        resp = httpx.post(f"{base}/v1/images/generations",
                          json={"prompt": "x", "n": 2.0, "seed": 2**63 - 1, "num_inference_steps": 1.0})
        assert resp.status_code == 200, resp.text
        assert [d["seed"] for d in resp.json()["data"]] == [2**63 - 1, 0]


# ------------------------------------------------- 15: operational routes, Host allow-list
def test_sleep_routes_are_served_only_with_sleep_mode(engine):
    with serve(create_app(engine, "m")) as base:  # the engine's config has no enable_sleep_mode
        for method, path in (("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping")):
            assert_openai_error(httpx.request(method, f"{base}{path}"), 404, code="not_found")
        assert not {"/sleep", "/wake_up", "/is_sleeping"} & set(httpx.get(f"{base}/openapi.json").json()["paths"])
        assert not engine.engine.is_sleeping
    with serve(create_app(engine, "m", enable_sleep_mode=True, api_key="k")) as base:
        assert_openai_error(httpx.post(f"{base}/sleep"), 401, code="invalid_api_key")
        bad = httpx.post(f"{base}/sleep", params={"level": 0}, headers={"Authorization": "Bearer k"})
        assert_openai_error(bad, 400, param="level")
        level = httpx.get(f"{base}/openapi.json").json()["paths"]["/sleep"]["post"]["parameters"][0]["schema"]
        assert (level["minimum"], level["maximum"]) == (1, 2)
    parser = build_parser()
    with pytest.raises(InvalidRequestError) as info:
        check_server_arguments(parser.parse_args(["serve", "--wake-on-request"]))
    assert info.value.field == "wake_on_request"
    args = parser.parse_args(["serve", "--wake-on-request", "--enable-sleep-mode"])
    check_server_arguments(args)


def test_lora_loading_route_is_served_only_with_a_lora_dir(engine):
    with serve(create_app(engine, "m")) as base:  # the engine's config has no lora_dir
        resp = httpx.post(f"{base}/v1/loras", json={"name": "x", "path": "x"})
        assert resp.status_code == 405 and resp.headers["allow"] == "GET"
        assert set(httpx.get(f"{base}/openapi.json").json()["paths"]["/v1/loras"]) == {"get"}


def test_host_allow_list_refuses_a_rebinding_host(engine):
    from diffserve.entrypoints.server_args import allowed_hosts

    parser = build_parser()
    loopback = allowed_hosts(parser.parse_args(["serve"]))  # --host 127.0.0.1 by default
    assert loopback == ["127.0.0.1", "::1", "localhost"]
    assert allowed_hosts(parser.parse_args(["serve", "--host", "0.0.0.0"])) is None  # any host
    assert allowed_hosts(parser.parse_args(["serve", "--host", "::1", "--public-url", "https://img.example/x"])) == [
        "127.0.0.1", "::1", "img.example", "localhost"]
    assert allowed_hosts(parser.parse_args(["serve", "--host", "0.0.0.0", "--allowed-hosts", "a.example,.b.example"])) \
        == [".b.example", "a.example"]
    assert allowed_hosts(parser.parse_args(["serve", "--allowed-hosts", "*"])) is None
    with pytest.raises(InvalidRequestError) as info:
        check_server_arguments(parser.parse_args(["serve", "--allowed-hosts", "http://x.example"]))
    assert info.value.field == "allowed_hosts"
    with serve(create_app(engine, "m", allowed_hosts=[*loopback, ".b.example"])) as base:
        port = base.rsplit(":", 1)[1]
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", "LOCALHOST", f"[::1]:{port}", "b.example",
                     "x.b.example:8"):
            assert httpx.get(f"{base}/v1/models", headers={"Host": host}).status_code == 200, host
        for host in (f"rebound.example:{port}", "127.0.0.1.evil.example", "b.example.evil", "localhost.evil"):
            for method, path in (("GET", "/v1/models"), ("GET", "/health"), ("GET", "/"),
                                 ("POST", "/v1/images/generations")):
                resp = httpx.request(method, f"{base}{path}", headers={"Host": host},
                                     json={"prompt": "x", **FAST})
                assert_openai_error(resp, 400, code="invalid_host")
        # the rebinding page cannot post an edit form either (same-origin by its Host), nor queue anything
        resp = httpx.post(f"{base}/v1/images/edits", headers={"Host": "rebound.example", "Origin": "http://rebound.example"},
                          files={"image": ("a.png", b"x", "image/png")}, data={"prompt": "x"})
        assert_openai_error(resp, 400, code="invalid_host")
        assert not engine.engine.has_unfinished_requests()
