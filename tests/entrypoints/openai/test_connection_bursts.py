"""Connection bursts against a server process under ``RLIMIT_NOFILE`` 1024, on asyncio's event
loop and on uvloop: the descriptors it holds stay within ``--max-connections`` plus the refusal
margin, every connection is answered, the log stays a few lines, and accept errors (EMFILE)
pause accepting, are counted in ``/metrics`` and logged once.

The server runs in a subprocess (`modelless_server.py`: the real app, `DiffserveServer`,
acceptor and protocol, with a model that never finishes loading, so the burst costs no model
load); the client side is `benchmarks/connection_burst.py`'s."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

import connection_burst as cb  # benchmarks/connection_burst.py (conftest puts benchmarks/ on sys.path)
from diffserve.entrypoints.openai.acceptor import REFUSAL_MARGIN

ROOT = Path(__file__).resolve().parents[3]
NOFILE = 1024
MAX_CONNECTIONS = 256
BURST = 5000
#: Descriptors the server may hold beyond its connections during a burst (threads' pipes, the
#: listening sockets, the sampler's reads are not its: measured growth besides connections is ~2).
SLACK = 24


def _loops() -> list[str]:
    loops = ["asyncio"]
    try:
        import uvloop  # noqa: F401 - installed with the ray extra (ray[serve] pulls it in)
        loops.append("uvloop")
    except ImportError:
        pass
    return loops


@pytest.fixture(scope="module")
def server():
    if not cb.raise_client_fd_limit(BURST):
        pytest.skip(f"the hard open-file limit is below the {BURST} client connections")
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    log = tempfile.NamedTemporaryFile(prefix="diffserve-burst-", suffix=".log", delete=False)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    popen = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("modelless_server.py")), ",".join(_loops()),
         str(MAX_CONNECTIONS), "2"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env, cwd=str(ROOT),
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE, hard)))
    try:
        line = popen.stdout.readline()
        assert line, Path(log.name).read_text()
        yield popen, json.loads(line), Path(log.name)
    finally:
        popen.stdin.close()
        try:
            popen.wait(30)
        except subprocess.TimeoutExpired:
            popen.kill()
            popen.wait()
        os.unlink(log.name)


def _log_lines(log: Path, start: int) -> list[str]:
    return log.read_bytes()[start:].decode(errors="replace").splitlines()


def test_burst_holds_at_most_the_limit_and_every_connection_is_answered(server):
    popen, ports, log = server
    for loop, port in ports.items():
        sampler = cb.FdSampler(popen.pid)
        base = sampler.count()
        start = log.stat().st_size
        with sampler:
            result = cb.burst(port, BURST, timeout_s=120)
        held = sampler.peak - base
        assert held <= MAX_CONNECTIONS + REFUSAL_MARGIN + SLACK, (loop, sampler.peak, base)
        assert held >= MAX_CONNECTIONS // 2, (loop, held)  # the burst did fill the server
        # every connection got an HTTP answer: 503 model_loading, or 503 over --max-connections
        assert result.statuses == {"503": BURST}, (loop, result.statuses)
        lines = _log_lines(log, start)
        assert not [line for line in lines if "Traceback" in line or "ERROR" in line], lines[:20]
        assert len(lines) <= 3, (loop, lines)  # one "refused a connection" line per 10 s at most
        metrics = cb.connection_metrics(port)
        assert metrics["diffserve_connections_accepted_total"] >= BURST
        assert metrics["diffserve_accept_errors_total{error=\"EMFILE\"}"] == 0
        assert cb.get(port, "/health")[0] == 503  # still answering (the model never loads here)


def test_accept_errors_pause_accepting_are_counted_and_logged_once(server):
    popen, ports, log = server
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    start = log.stat().st_size
    results = {}
    sampler = cb.FdSampler(popen.pid)
    base = sampler.count()
    resource.prlimit(popen.pid, resource.RLIMIT_NOFILE, (base + 16, hard))  # room for ~16 connections
    try:
        for loop, port in ports.items():
            results[loop] = cb.burst(port, 300, timeout_s=60)
    finally:
        resource.prlimit(popen.pid, resource.RLIMIT_NOFILE, (NOFILE, hard))
    for loop, port in ports.items():
        # accepting paused and resumed: every connection was answered, none reset
        assert results[loop].statuses == {"503": 300}, (loop, results[loop].statuses)
        metrics = cb.connection_metrics(port)
        assert metrics["diffserve_accept_errors_total{error=\"EMFILE\"}"] >= 1, (loop, metrics)
    lines = _log_lines(log, start)
    accept_lines = [line for line in lines if "cannot accept connections" in line]
    assert 1 <= len(accept_lines) <= 2 and "EMFILE" in accept_lines[0], lines
    assert not [line for line in lines if "Traceback" in line], lines[:20]
    assert len(lines) <= 4, lines
