"""Memory of ``diffserve serve --replicas N`` on a local Ray instance, with and without Ray's
dashboard (``--ray-dashboard``), arms interleaved.

Each run starts the real CLI (a fresh local Ray instance, N replicas of the built-in digits model
with 1 torch thread each), waits until ``/health`` answers and one image was generated through
every replica's path, lets the processes settle, then sums over the CLI process and every
descendant (Ray's GCS, raylet, dashboard and its agents, workers, the replicas): the number of
processes, their PSS (proportional set size: shared pages split between the processes that map
them, so the sum is what the group costs the machine) and RSS (pages counted in every process
that maps them: an upper bound), then stops it with SIGTERM. Prints one JSON line per run and a
summary (median [min-max] per arm, and the dashboard's share).

Usage: ``python benchmarks/ray_memory.py [--replicas 2] [--repeats 3] [--settle 10]`` (needs the
``ray`` and ``serve`` extras; each run takes 1-3 minutes on a loaded 2-core machine).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def tree_memory(root: psutil.Process) -> dict:
    """Processes, PSS and RSS (bytes) of `root` and its descendants; names of the 8 largest."""
    processes, pss, rss, sizes = 0, 0, 0, []
    for proc in [root, *root.children(recursive=True)]:
        try:
            info = proc.memory_full_info()
            name = " ".join(proc.cmdline()[:3])[:90] or proc.name()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        processes += 1
        pss += info.pss
        rss += info.rss
        sizes.append((info.pss, name))
    return {"processes": processes, "pss_bytes": pss, "rss_bytes": rss,
            "largest": [(round(p / 2**20), n) for p, n in sorted(sizes, reverse=True)[:8]]}


def run_once(replicas: int, dashboard: bool, settle_s: float, timeout_s: float) -> dict:
    """Start the CLI, wait, measure, stop; the measurement (and the start-up time, seconds)."""
    port = _free_port()
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    argv = [sys.executable, "-m", "diffserve", "serve", "--replicas", str(replicas), "--threads", "1",
            "--port", str(port), "--log-level", "warning", *(["--ray-dashboard"] if dashboard else [])]
    start = time.monotonic()
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"diffserve serve exited {proc.returncode}: {Path(log.name).read_text()[-2000:]}")
            if time.monotonic() - start > timeout_s:
                raise RuntimeError(f"not healthy after {timeout_s:.0f} s")
            try:
                if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        up_s = time.monotonic() - start
        with httpx.Client(timeout=120) as client:
            for seed in range(2 * replicas):
                response = client.post(f"{base}/v1/images/generations",
                                       json={"prompt": "a handwritten digit 3", "seed": seed})
                response.raise_for_status()
        time.sleep(settle_s)
        return {"dashboard": dashboard, "replicas": replicas, "startup_s": round(up_s, 1),
                **tree_memory(psutil.Process(proc.pid))}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        Path(log.name).unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--settle", type=float, default=10.0, help="seconds between the last request and measuring")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for /health")
    args = parser.parse_args(argv)
    runs = []
    for _ in range(args.repeats):
        for dashboard in (True, False):  # interleaved: the machine's drift hits both arms
            result = run_once(args.replicas, dashboard, args.settle, args.timeout)
            print(json.dumps(result), flush=True)
            runs.append(result)

    def summary(dashboard: bool, key: str, scale: float = 1.0) -> str:
        values = [r[key] / scale for r in runs if r["dashboard"] is dashboard]
        return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"

    for dashboard in (True, False):
        print(f"{'with' if dashboard else 'without'} dashboard: processes {summary(dashboard, 'processes')}, "
              f"PSS {summary(dashboard, 'pss_bytes', 2**30)} GiB, RSS {summary(dashboard, 'rss_bytes', 2**30)} GiB, "
              f"start-up {summary(dashboard, 'startup_s')} s")
    return runs


if __name__ == "__main__":
    main()
