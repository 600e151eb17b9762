"""`SharedMemoryConnector`: the stages are processes; payloads cross in POSIX shared memory.

One object per process, on each side of the channel:

- **producer** (the AR stage's process): `put` packs each DISTINCT payload (by content hash)
  into its own shared-memory segment (``/dev/shm/diffserve-<pid>-<hash>`` on Linux): one copy,
  the only one. A payload already held (the empty negative prompt's K/V of every request) is
  not written again; its segment gains a reference. `free` drops the request's references and
  unlinks a segment when its last reference goes. Segments still held when the producer
  process exits are unlinked by Python's resource tracker.
- **consumer** (the DiT runner's process): `get` maps the segments named in the handle
  copy-on-write (``MAP_PRIVATE``: the consumer can never change the producer's bytes) and
  returns tensors VIEWING the mapping, no copy. `free` drops this side's references; a mapping
  is unmapped once no tensor views it any more. A segment the producer already unlinked (the
  request was aborted meanwhile) raises `PayloadMissingError`.

The handle carries each part's segment name, so the consumer needs nothing else. Both sides
count their work in `stats` (bytes copied on the producer side; bytes mapped on the consumer
side as ``extra["bytes_mapped"]``).
"""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Mapping, Sequence
from multiprocessing import shared_memory

from diffserve.connector.base import Connector
from diffserve.connector.handles import ConnectorStats, PartRef, PayloadHandle, PayloadMissingError
from diffserve.connector.payload import Payload, unpack

#: Prefix of the segment names (tests look for leaks by it).
SEGMENT_PREFIX = "diffserve-"


def _open_segment(name: str) -> mmap.mmap:
    """Map an existing segment copy-on-write (without registering it with the resource
    tracker, which would unlink the producer's segment when this process exits).

    Raises:
        FileNotFoundError: no such segment (unlinked).
    """
    try:
        import _posixshmem  # CPython's POSIX shm_open (what multiprocessing.shared_memory uses)

        fd = _posixshmem.shm_open("/" + name, os.O_RDONLY, mode=0o600)
    except ImportError:  # pragma: no cover - non-POSIX platforms
        fd = os.open(os.path.join("/dev/shm", name), os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        return mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


class SharedMemoryConnector(Connector):
    """Payloads in shared-memory segments (see the module docstring).

    Args:
        prefix: segment-name prefix (default `SEGMENT_PREFIX`).
    """

    name = "shared_memory"

    def __init__(self, prefix: str = SEGMENT_PREFIX) -> None:
        self.prefix = prefix
        self._lock = threading.Lock()
        # producer side: digest -> [SharedMemory, references]; request -> handle
        self._segments: dict[str, list] = {}
        self._produced: dict[str, PayloadHandle] = {}
        # consumer side: digest -> [Payload viewing the mapping, references]; request -> handle
        self._mapped: dict[str, list] = {}
        self._consumed: dict[str, PayloadHandle] = {}
        self._stats = ConnectorStats(extra={"bytes_mapped": 0, "segments": 0})

    # ------------------------------------------------------------------ producer
    def put(self, request_id: str, parts: Mapping[str, Payload]) -> PayloadHandle:
        if not parts:
            raise ValueError(f"request {request_id!r}: put needs at least one branch payload")
        refs: list[PartRef] = []
        with self._lock:
            if request_id in self._produced:
                raise ValueError(f"request {request_id!r} already has payloads in this connector")
            s = self._stats
            created: list[str] = []
            try:
                for branch, payload in parts.items():
                    digest = payload.digest
                    entry = self._segments.get(digest)
                    if entry is None:
                        size = payload.packed_size()
                        segment = shared_memory.SharedMemory(f"{self.prefix}{os.getpid()}-{digest}", create=True,
                                                             size=max(size, 1))
                        s.bytes_copied += payload.pack_into(segment.buf)
                        entry = self._segments[digest] = [segment, 0, payload.nbytes]
                        created.append(digest)
                        s.resident_payloads += 1
                        s.resident_bytes += payload.nbytes
                        s.extra["segments"] += 1
                    else:
                        s.dedup_hits += 1
                        s.dedup_bytes += payload.nbytes
                    entry[1] += 1
                    refs.append(PartRef(branch, digest, payload.nbytes, entry[0].name))
            except BaseException:
                for ref in refs:  # undo this request's references; drop the segments it created
                    self._segments[ref.digest][1] -= 1
                for digest in created:
                    self._drop_segment(digest)
                raise
            for ref in refs:
                s.parts_put += 1
                s.bytes_put += ref.nbytes
            handle = PayloadHandle(request_id, self.name, tuple(refs))
            self._produced[request_id] = handle
            s.puts += 1
            s.resident_requests += 1
            s.peak_resident_bytes = max(s.peak_resident_bytes, s.resident_bytes)
            return handle

    def _drop_segment(self, digest: str) -> None:
        segment, _, nbytes = self._segments.pop(digest)
        segment.close()
        try:
            segment.unlink()
        except FileNotFoundError:  # pragma: no cover - removed from outside
            pass
        self._stats.resident_payloads -= 1
        self._stats.resident_bytes -= nbytes
        self._stats.extra["segments"] -= 1

    # ------------------------------------------------------------------ consumer
    def get(self, handle: PayloadHandle, branches: Sequence[str] | None = None) -> dict[str, Payload]:
        wanted = handle.branches if branches is None else tuple(branches)
        with self._lock:
            s = self._stats
            try:
                handle.require(list(wanted))
                held = self._consumed.get(handle.request_id)
                if held is None:
                    self._map(handle)
            except PayloadMissingError:
                s.missing += 1
                raise
            s.gets += 1
            return {ref.branch: self._mapped[ref.digest][0] for ref in handle.parts if ref.branch in wanted}

    def _map(self, handle: PayloadHandle) -> None:
        """Map every part of `handle` (lock held); all or nothing."""
        mapped: list[str] = []
        try:
            for ref in handle.parts:
                entry = self._mapped.get(ref.digest)
                if entry is None:
                    try:
                        payload = unpack(_open_segment(ref.location))
                    except FileNotFoundError:
                        raise PayloadMissingError(
                            f"request {handle.request_id!r}: the {ref.branch!r} branch payload is gone from shared "
                            "memory (its producer freed it: the request ended)") from None
                    entry = self._mapped[ref.digest] = [payload, 0]
                    self._stats.extra["bytes_mapped"] += ref.nbytes
                entry[1] += 1
                mapped.append(ref.digest)
        except BaseException:
            for digest in mapped:
                self._unref_mapping(digest)
            raise
        self._consumed[handle.request_id] = handle

    def _unref_mapping(self, digest: str) -> None:
        entry = self._mapped[digest]
        entry[1] -= 1
        if entry[1] == 0:
            del self._mapped[digest]  # unmapped when no tensor views it any more

    # ------------------------------------------------------------------ both
    def free(self, request_id: str) -> None:
        with self._lock:
            freed = False
            handle = self._consumed.pop(request_id, None)
            if handle is not None:
                for ref in handle.parts:
                    self._unref_mapping(ref.digest)
                freed = True
            handle = self._produced.pop(request_id, None)
            if handle is not None:
                for ref in handle.parts:
                    entry = self._segments[ref.digest]
                    entry[1] -= 1
                    if entry[1] == 0:
                        self._drop_segment(ref.digest)
                self._stats.resident_requests -= 1
                freed = True
            if freed:
                self._stats.frees += 1

    def stats(self) -> ConnectorStats:
        with self._lock:
            values = {k: v for k, v in vars(self._stats).items() if k != "extra"}
            extra = dict(self._stats.extra, mapped_payloads=len(self._mapped))
            return ConnectorStats(**values, extra=extra)

    def close(self) -> None:
        for request_id in list(self._produced) + list(self._consumed):
            self.free(request_id)


def leaked_segments(prefix: str = SEGMENT_PREFIX) -> list[str]:
    """Names of the shared-memory segments with `prefix` that exist now (Linux: ``/dev/shm``)."""
    try:
        return sorted(n for n in os.listdir("/dev/shm") if n.startswith(prefix))
    except FileNotFoundError:  # pragma: no cover - no /dev/shm
        return []


__all__ = ["SEGMENT_PREFIX", "SharedMemoryConnector", "leaked_segments"]
