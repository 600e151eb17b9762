"""`PayloadReceiver`: the DiT runner's side of the connector, with fetches started early.

The engine hands a multi-stage request's `PayloadHandle` to the DiT runner when the request is
ADMITTED (`prefetch`), not when its first forward needs it: the fetch (``connector.get``: map the
shared-memory segments, or take the in-process references; then move the tensors to the device)
starts at once on a side thread, beside the running requests' steps and the request's own
prompt preparation. `receive` (called by `prepare`) waits for it and records how long it
waited: the DiT-side wait for the payload, ~0 when the fetch finished in time.

Lifetimes: `release` drops the runner's side (the received tensors and the connector's
consumer-side hold) when the request is freed: finished, failed or aborted.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from diffserve.connector.base import Connector
from diffserve.connector.handles import PayloadHandle, PayloadMissingError


class PayloadReceiver:
    """Prefetches and hands over requests' payloads (see the module docstring).

    Args:
        connector: the consumer side of the stage's connector.
        device: where the DiT computes (payload tensors are moved there).
    """

    def __init__(self, connector: Connector, device: torch.device):
        self.connector = connector
        self.device = torch.device(device)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="diffserve-payload-fetch",
                                        initializer=torch.set_num_threads, initargs=(1,))
        self._lock = threading.Lock()
        self._fetches: dict[str, tuple[Future, float]] = {}
        self.counters = {"prefetched": 0, "received": 0, "wait_s": 0.0, "fetch_s": 0.0, "bytes": 0}

    def _fetch(self, handle: PayloadHandle, branches: tuple[str, ...]) -> tuple[dict[str, Any], float]:
        start = time.perf_counter()
        parts = self.connector.get(handle, branches)
        non_blocking = self.device.type == "cuda"
        parts = {name: payload.to(self.device, non_blocking=non_blocking) for name, payload in parts.items()}
        if non_blocking:
            torch.cuda.current_stream(self.device).synchronize()
        return parts, time.perf_counter() - start

    def prefetch(self, handle: PayloadHandle, branches: tuple[str, ...]) -> None:
        """Start fetching a request's payloads (the branches its DiT stage needs); a missing
        branch fails the fetch (and later `receive`) with `PayloadMissingError`."""
        with self._lock:
            if handle.request_id in self._fetches:
                return
            self._fetches[handle.request_id] = (self._pool.submit(self._fetch, handle, tuple(branches)),
                                                time.perf_counter())
            self.counters["prefetched"] += 1

    def receive(self, handle: PayloadHandle, branches: tuple[str, ...]) -> tuple[dict[str, Any], float, float]:
        """A request's payloads, prefetching now if `prefetch` was not called.

        Returns:
            ``(parts by branch, seconds waited here, seconds the fetch took)``.

        Raises:
            PayloadMissingError: a needed branch is missing or the payloads are gone.
        """
        self.prefetch(handle, branches)
        with self._lock:
            future, _ = self._fetches[handle.request_id]
        start = time.perf_counter()
        parts, fetch_s = future.result()
        waited = time.perf_counter() - start
        with self._lock:
            self.counters["received"] += 1
            self.counters["wait_s"] += waited
            self.counters["fetch_s"] += fetch_s
            self.counters["bytes"] += sum(p.nbytes for p in parts.values())
        return parts, waited, fetch_s

    def release(self, request_id: str) -> None:
        """Drop the request's fetch and the connector's consumer-side hold (idempotent)."""
        with self._lock:
            entry = self._fetches.pop(request_id, None)
        if entry is not None and not entry[0].done():
            entry[0].add_done_callback(lambda _: self.connector.free(request_id))
        self.connector.free(request_id)

    def stats(self) -> dict[str, Any]:
        """Counters (prefetched, received, total seconds waited and fetching, bytes received),
        pending fetches, and the connector side's accounting."""
        with self._lock:
            out = dict(self.counters, pending=len(self._fetches))
        out["connector"] = self.connector.stats().as_dict()
        return out

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


__all__ = ["PayloadMissingError", "PayloadReceiver"]
