"""Running the real server in tests: uvicorn with diffserve's connection protocol on a free
127.0.0.1 port, in a thread."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from diffserve import AsyncDiffusionEngine, EngineConfig
from diffserve.entrypoints.openai.http_protocol import ConnectionLimits
from diffserve.entrypoints.openai.server import DiffserveServer, uvicorn_config

#: Steps of a request meant to still be running when the test acts on it (aborted long before
#: the end: a step takes ~1 ms on the tiny model, so this leaves seconds of margin).
LONG_STEPS = 20_000


def new_engine(model_dir, **overrides) -> AsyncDiffusionEngine:
    """An async engine on `model_dir` with one torch thread (requests may ask for `LONG_STEPS`)."""
    overrides.setdefault("max_num_inference_steps", LONG_STEPS)
    return AsyncDiffusionEngine(EngineConfig(model=str(model_dir), num_threads=1, **overrides))


@contextmanager
def serve(app, limits: ConnectionLimits = ConnectionLimits(), log_level: str = "warning"):
    """Run `app` as ``diffserve serve`` does (same uvicorn configuration and protocol) on a free
    127.0.0.1 port in a thread; yields the base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    state = getattr(app.state, "diffserve", None)
    server = DiffserveServer(uvicorn_config(app, "127.0.0.1", port, limits=limits, log_level=log_level),
                             state.metrics.connections if state is not None else None)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


def wait_until(predicate, timeout=10.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def assert_openai_error(resp: httpx.Response, status: int, param=None, code=None):
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err


def sse_events(response: httpx.Response) -> Iterator[tuple[str | None, dict]]:
    """(event name, parsed JSON data) of a streamed server-sent-events response, as they arrive
    (the name is None for a ``data:`` line before any ``event:`` line)."""
    name = None
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line[len("event: "):]
        elif line.startswith("data: "):
            yield name, json.loads(line[len("data: "):])
