"""`InProcessConnector`: the stages share one process (and this object); payloads are passed by
reference, never copied.

Equal payloads (same `Payload.digest`) are stored once: the first request's payload object is
kept and every later request with the same content gets that object back from `get` (its own
copy is dropped at `put`). Thread-safe: the AR stage puts on its thread, the DiT runner gets on
its own, the engine frees.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence

from diffserve.connector.base import Connector
from diffserve.connector.handles import ConnectorStats, PartRef, PayloadHandle, PayloadMissingError
from diffserve.connector.payload import Payload


class InProcessConnector(Connector):
    """Payloads by reference, deduplicated by content hash (see the module docstring)."""

    name = "inprocess"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: digest -> [payload, number of (request, branch) references]
        self._store: dict[str, list] = {}
        self._requests: dict[str, PayloadHandle] = {}
        self._stats = ConnectorStats()

    def put(self, request_id: str, parts: Mapping[str, Payload]) -> PayloadHandle:
        if not parts:
            raise ValueError(f"request {request_id!r}: put needs at least one branch payload")
        refs = tuple(PartRef(branch, p.digest, p.nbytes) for branch, p in parts.items())  # hash outside the lock
        with self._lock:
            if request_id in self._requests:
                raise ValueError(f"request {request_id!r} already has payloads in this connector")
            s = self._stats
            for ref, payload in zip(refs, parts.values()):
                entry = self._store.get(ref.digest)
                if entry is None:
                    self._store[ref.digest] = [payload, 1]
                    s.resident_payloads += 1
                    s.resident_bytes += ref.nbytes
                else:
                    entry[1] += 1
                    s.dedup_hits += 1
                    s.dedup_bytes += ref.nbytes
                s.parts_put += 1
                s.bytes_put += ref.nbytes
            handle = PayloadHandle(request_id, self.name, refs)
            self._requests[request_id] = handle
            s.puts += 1
            s.resident_requests += 1
            s.peak_resident_bytes = max(s.peak_resident_bytes, s.resident_bytes)
            return handle

    def get(self, handle: PayloadHandle, branches: Sequence[str] | None = None) -> dict[str, Payload]:
        with self._lock:
            try:
                handle.require(list(branches) if branches is not None else [])
                if self._requests.get(handle.request_id) != handle:
                    raise PayloadMissingError(f"request {handle.request_id!r}: its payloads are not in the connector "
                                              "(freed, or never put)")
            except PayloadMissingError:
                self._stats.missing += 1
                raise
            wanted = handle.branches if branches is None else tuple(branches)
            out = {ref.branch: self._store[ref.digest][0] for ref in handle.parts if ref.branch in wanted}
            self._stats.gets += 1
            return out

    def free(self, request_id: str) -> None:
        with self._lock:
            handle = self._requests.pop(request_id, None)
            if handle is None:
                return
            s = self._stats
            for ref in handle.parts:
                entry = self._store[ref.digest]
                entry[1] -= 1
                if entry[1] == 0:
                    del self._store[ref.digest]
                    s.resident_payloads -= 1
                    s.resident_bytes -= ref.nbytes
            s.frees += 1
            s.resident_requests -= 1

    def stats(self) -> ConnectorStats:
        with self._lock:
            return ConnectorStats(**{k: v for k, v in vars(self._stats).items() if k != "extra"})

    def close(self) -> None:
        for request_id in list(self._requests):
            self.free(request_id)


__all__ = ["InProcessConnector"]
