"""Connection bursts against a real ``diffserve serve`` process: descriptors held, answers, log.

Starts the server (the built-in model unless ``--model``) in a subprocess under a given
``RLIMIT_NOFILE``, opens ``--connections`` TCP connections to it at once (non-blocking
connects, then one ``GET /health`` each, ``Connection: close``; by default once the model loaded,
``--during-load`` while it loads), and reports:

- the peak number of descriptors the server process held (``/proc/PID/fd`` sampled every ~2 ms
  from a thread), against ``--max-connections``;
- how the connections ended: an HTTP status (200, 503 = loading or over the connection limit),
  reset / refused / timed out;
- how many lines and bytes the server logged during the burst, and how many of them were
  tracebacks;
- the server's ``diffserve_connections_*`` / ``diffserve_accept_errors_total`` metrics after it.

Each event loop is an arm: ``asyncio`` runs the server with uvloop made unimportable (as with
the ``serve`` extra alone), ``uvloop`` with it importable (as with the ``ray`` extra, which
pulls it in). ``--repeats R`` interleaves the arms R times and prints the median and range.

Usage:
    python benchmarks/connection_burst.py                                 # 5000 conns, limit 1024
    python benchmarks/connection_burst.py --connections 2000 --nofile 1024 --max-connections 256 --repeats 3

The client needs more descriptors than ``--connections``: it raises its own soft limit up to the
hard one (``ulimit -Hn``).
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import re
import resource
import selectors
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOOPS = ("asyncio", "uvloop")

#: Runs ``diffserve serve`` with the event loop chosen: ``asyncio`` hides uvloop from uvicorn's
#: ``loop="auto"`` (an installed uvloop is what changes the loop, see the module docstring).
_WRAPPER = """\
import sys
if sys.argv[1] == "asyncio":
    sys.modules["uvloop"] = None
from diffserve.entrypoints.cli import main
sys.exit(main(sys.argv[2:]))
"""


@dataclass
class ServerProcess:
    """A running ``diffserve serve`` subprocess: its `popen`, `port` and `log` file."""

    popen: subprocess.Popen
    port: int
    log: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def log_size(self) -> tuple[int, int]:
        """(lines, bytes) logged so far."""
        data = self.log.read_bytes()
        return data.count(b"\n"), len(data)

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM, wait; returns the exit status."""
        if self.popen.poll() is None:
            self.popen.terminate()
        try:
            return self.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            return self.popen.wait()


def start_server(loop: str, nofile: int, max_connections: int, log_dir: Path, *, model: str | None = None,
                 extra: tuple[str, ...] = (), timeout_s: float = 120.0) -> ServerProcess:
    """Start ``diffserve serve --port 0`` on `loop` under ``RLIMIT_NOFILE`` = `nofile` (soft)
    and wait until it listens (not until the model loaded).

    Raises:
        RuntimeError: the server exited or did not listen within `timeout_s` seconds.
    """
    log = log_dir / f"server-{loop}-{time.monotonic_ns()}.log"
    args = ["serve", "--port", "0", "--threads", "1", "--max-connections", str(max_connections), *extra]
    if model is not None:
        args += ["--model", model]
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, hard))

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    with open(log, "wb") as out:
        popen = subprocess.Popen([sys.executable, "-c", _WRAPPER, loop, *args], stdout=out, stderr=subprocess.STDOUT,
                                 preexec_fn=limit, env=env, cwd=str(ROOT))
    deadline = time.monotonic() + timeout_s
    pattern = re.compile(rb"serving .* on http://127\.0\.0\.1:(\d+)")
    while time.monotonic() < deadline:
        match = pattern.search(log.read_bytes())
        if match:
            port = int(match.group(1))
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return ServerProcess(popen, port, log)
            except OSError:
                pass
        if popen.poll() is not None:
            raise RuntimeError(f"the server exited with {popen.returncode}:\n{log.read_text()[-3000:]}")
        time.sleep(0.05)
    popen.kill()
    raise RuntimeError(f"the server did not listen within {timeout_s}s:\n{log.read_text()[-3000:]}")


class FdSampler:
    """Samples a process's open descriptors (``/proc/PID/fd``) every `interval_s` in a thread."""

    def __init__(self, pid: int, interval_s: float = 0.002):
        self.pid = pid
        self.interval_s = interval_s
        self.peak = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def count(self) -> int:
        try:
            return len(os.listdir(f"/proc/{self.pid}/fd"))
        except OSError:
            return 0

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.count())
            self.samples += 1
            time.sleep(self.interval_s)

    def __enter__(self) -> "FdSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


@dataclass
class BurstResult:
    """How the connections of a burst ended (counts) and how long it took."""

    statuses: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    def add(self, outcome: str) -> None:
        self.statuses[outcome] = self.statuses.get(outcome, 0) + 1

    @property
    def answered(self) -> int:
        return sum(v for k, v in self.statuses.items() if k.isdigit())


def raise_client_fd_limit(needed: int) -> bool:
    """Raise this process's soft ``RLIMIT_NOFILE`` to hold `needed` more descriptors; False
    when the hard limit does not allow it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = needed + 256
    if soft != resource.RLIM_INFINITY and soft < want:
        if hard != resource.RLIM_INFINITY and hard < want:
            return False
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    return True


def burst(port: int, connections: int, timeout_s: float = 60.0, path: str = "/health") -> BurstResult:
    """Open `connections` connections to 127.0.0.1:`port` at once, send ``GET path`` on each
    as soon as it is connected, read each answer until the server closes; returns how each
    ended (``"200"``, ``"503"``, ..., ``"reset"``, ``"refused"``, ``"closed"`` = closed without
    an answer, ``"timeout"``)."""
    request = f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n".encode()
    result = BurstResult()
    selector = selectors.DefaultSelector()
    start = time.monotonic()
    buffers: dict[socket.socket, bytearray] = {}
    for _ in range(connections):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        code = sock.connect_ex(("127.0.0.1", port))
        if code not in (0, errno.EINPROGRESS):
            result.add("refused" if code == errno.ECONNREFUSED else errno.errorcode.get(code, str(code)))
            sock.close()
            continue
        selector.register(sock, selectors.EVENT_WRITE)
    deadline = start + timeout_s

    def finish(sock: socket.socket, outcome: str) -> None:
        selector.unregister(sock)
        sock.close()
        buffers.pop(sock, None)
        result.add(outcome)

    while selector.get_map() and time.monotonic() < deadline:
        for key, events in selector.select(timeout=0.1):
            sock = key.fileobj
            if events & selectors.EVENT_WRITE and sock not in buffers:
                error = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if error:
                    finish(sock, "refused" if error == errno.ECONNREFUSED else "reset")
                    continue
                try:
                    sock.send(request)
                except OSError:
                    finish(sock, "reset")
                    continue
                buffers[sock] = bytearray()
                selector.modify(sock, selectors.EVENT_READ)
                continue
            try:
                chunk = sock.recv(65536)
            except BlockingIOError:
                continue
            except OSError:
                data = buffers.get(sock, b"")
                finish(sock, _status(data) or "reset")
                continue
            if chunk:
                buffers[sock].extend(chunk)
                continue
            finish(sock, _status(buffers[sock]) or "closed")
    for key in list(selector.get_map().values()):
        finish(key.fileobj, "timeout")
    selector.close()
    result.seconds = time.monotonic() - start
    return result


def _status(data: bytes) -> str | None:
    match = re.match(rb"HTTP/1\.1 (\d{3})", bytes(data))
    return match.group(1).decode() if match else None


def get(port: int, path: str, timeout_s: float = 10.0) -> tuple[int, str]:
    """A plain ``GET`` (status, body) on a fresh connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n".encode())
        data = bytearray()
        while chunk := sock.recv(65536):
            data.extend(chunk)
    head, _, body = bytes(data).partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body.decode(errors="replace")


def _status_or_none(port: int, path: str) -> int | None:
    try:
        return get(port, path, timeout_s=5)[0]
    except OSError:
        return None


def connection_metrics(port: int) -> dict[str, float]:
    """The ``diffserve_connections_*`` and ``diffserve_accept_errors_total`` samples of ``/metrics``."""
    status, body = get(port, "/metrics")
    assert status == 200, status
    samples = {}
    for line in body.splitlines():
        if line.startswith(("diffserve_connections", "diffserve_accept_errors")):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def run_arm(loop: str, args: argparse.Namespace, log_dir: Path) -> dict:
    """One burst against a fresh server on `loop`; the measurements as a dict."""
    server = start_server(loop, args.nofile, args.max_connections, log_dir, model=args.model,
                          extra=("--header-timeout", str(args.header_timeout)))
    try:
        if not args.during_load:
            deadline = time.monotonic() + 300
            while _status_or_none(server.port, "/health") != 200:
                if time.monotonic() > deadline or server.popen.poll() is not None:
                    raise RuntimeError(f"the model did not load:\n{server.log.read_text()[-3000:]}")
                time.sleep(0.2)
        with FdSampler(server.pid) as sampler:
            time.sleep(0.2)
            base_fds = sampler.count()
            lines_before, bytes_before = server.log_size()
            result = burst(server.port, args.connections, timeout_s=args.timeout)
        lines_after, bytes_after = server.log_size()
        log_text = server.log.read_bytes()[bytes_before:].decode(errors="replace")
        try:
            metrics = connection_metrics(server.port)
        except OSError as exc:
            metrics = {"unreachable": str(exc), "exit_status": server.popen.poll()}
        return {"loop": loop, "peak_fds": sampler.peak, "base_fds": base_fds, "samples": sampler.samples,
                "seconds": round(result.seconds, 2), "outcomes": dict(sorted(result.statuses.items())),
                "log_lines": lines_after - lines_before, "log_bytes": bytes_after - bytes_before,
                "tracebacks": log_text.count("Traceback"), "metrics": metrics}
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, default=5000, help="connections opened at once")
    parser.add_argument("--nofile", type=int, default=1024, help="the server's RLIMIT_NOFILE (soft)")
    parser.add_argument("--max-connections", type=int, default=256, help="the server's --max-connections")
    parser.add_argument("--header-timeout", type=float, default=10.0, help="the server's --header-timeout")
    parser.add_argument("--loops", default=",".join(LOOPS), help="arms: asyncio, uvloop")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds the client waits for all answers")
    parser.add_argument("--model", default=None, help="model folder or name (default: the built-in one)")
    parser.add_argument("--during-load", action="store_true",
                        help="burst as soon as the server listens, while its model loads (default: once /health "
                             "answers 200)")
    parser.add_argument("--json", action="store_true", help="end with one JSON line of every run")
    parser.add_argument("--log-dir", default=None, help="keep the server logs in this folder (default: deleted)")
    args = parser.parse_args(argv)
    if not raise_client_fd_limit(args.connections):
        parser.error(f"the hard open-file limit ({resource.getrlimit(resource.RLIMIT_NOFILE)[1]}) is below "
                     f"--connections {args.connections}")
    loops = [loop.strip() for loop in args.loops.split(",") if loop.strip()]
    runs: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="diffserve-burst-") as tmp:
        if args.log_dir is not None:
            Path(args.log_dir).mkdir(parents=True, exist_ok=True)
            tmp = args.log_dir
        for repeat in range(args.repeats):
            for loop in loops:
                run = run_arm(loop, args, Path(tmp))
                run["repeat"] = repeat
                runs.append(run)
                print(f"[{repeat}] {loop:8s} peak fds {run['peak_fds']:5d} (base {run['base_fds']}, "
                      f"--max-connections {args.max_connections}, nofile {args.nofile}); {run['seconds']:6.2f}s; "
                      f"log {run['log_lines']} lines / {run['log_bytes']} B, {run['tracebacks']} tracebacks; "
                      f"{run['outcomes']}; {run['metrics']}", flush=True)
    print(f"\n{args.connections} connections at once, server --max-connections {args.max_connections}, "
          f"RLIMIT_NOFILE {args.nofile}; median [min-max] of {args.repeats}:")
    for loop in loops:
        mine = [r for r in runs if r["loop"] == loop]
        for key in ("peak_fds", "log_lines", "tracebacks", "seconds"):
            values = [r[key] for r in mine]
            print(f"  {loop:8s} {key:10s} {statistics.median(values):g} [{min(values):g}-{max(values):g}]")
    if args.json:
        print(json.dumps(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
