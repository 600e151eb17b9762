"""Store of encoded images behind ``response_format="url"``.

Promise: an image stays downloadable until the ``expires_at`` its response stated (``ttl_s``
seconds after it was stored), as long as the server runs. Nothing is ever evicted early to make
room. Instead a ``url`` request first *reserves* room for its images (`ImageStore.reserve`, an
upper bound of their encoded size); when the store is full it is refused before any compute
(`StoreFullError`, HTTP 503 with ``Retry-After`` = seconds until the oldest image expires),
and the client can retry or use ``b64_json``.

Bounds: at most `max_images` images; at most `max_memory_bytes` bytes in memory, the oldest
images beyond that spilled to files in `spill_dir` (when given) up to `max_spill_bytes`. A
restart forgets everything; spilled files are deleted when they expire and at `close`. File
names are random (128 bits), so they act as capabilities.

Shared mode (``shared=True``, for replicas: `diffserve.entrypoints.ray_serve`): the folder *is*
the store, so a link written by one process is served by any other process with a store on the
same folder (another replica, on any node that mounts it). Every image is written there at once
(atomically: a hidden temporary file renamed into place), named ``<random>.<extension>``, with
its modification time set to its expiry time (wall clock, seconds since the epoch: the nodes'
clocks must agree, e.g. by NTP). A name this store did not write is looked up in the folder and
served until that time. Files outlive the process that wrote them: `close` forgets them without
deleting them (a replica that stops or dies breaks no promise), and every store deletes expired
files it finds in the folder (at most every `SWEEP_INTERVAL_S` seconds). Each store's caps count
the images it wrote; memory caps do not apply (nothing is kept in memory).
"""

from __future__ import annotations

import math
import os
import re
import secrets
import shutil
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from diffserve.media.image_encoding import MEDIA_TYPES
from diffserve.core.errors import InvalidRequestError

#: Default lifetime of a stored image, seconds.
DEFAULT_TTL_S = 3600.0
#: Default cap on stored images.
DEFAULT_MAX_IMAGES = 4096
#: Default cap on bytes kept in memory (256 MiB).
DEFAULT_MAX_BYTES = 256 * 2**20
#: Default cap on bytes spilled to disk (4 GiB).
DEFAULT_MAX_SPILL_BYTES = 4 * 2**30
#: Shared mode: seconds between scans of the folder for expired files of any writer.
SWEEP_INTERVAL_S = 60.0
#: Names of stored images: 16 random bytes in URL-safe base64, then the format's extension.
_NAME = re.compile(r"[A-Za-z0-9_-]{22}\.(%s)" % "|".join(MEDIA_TYPES))
#: Temporary files of shared mode's atomic writes.
_TEMPORARY = re.compile(r"\.[A-Za-z0-9_-]{22}\.(%s)\.tmp" % "|".join(MEDIA_TYPES))


def encoded_size_bound(width: int, height: int) -> int:
    """Upper bound in bytes of one encoded ``width`` x ``height`` RGB image (PNG, JPEG or WebP
    at any quality): the raw pixels plus 10% and 4 KiB of headers."""
    return math.ceil(width * height * 3 * 1.1) + 4096


class StoreFullError(Exception):
    """No room for the images of a request without breaking an earlier promise.

    Attributes:
        retry_after_s: whole seconds until the oldest stored image expires (>= 1).
    """

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class StoredImage:
    """An encoded image and its media type; `expires_at` is on the store's monotonic clock."""

    data: bytes
    media_type: str
    expires_at: float


@dataclass
class _Entry:
    media_type: str
    size: int
    expires_at: float
    data: bytes | None = None  # None when spilled
    path: Path | None = None


class Reservation:
    """Room held for up to `count` images and `nbytes` bytes; `ImageStore.put` uses it up and
    `release` returns what is left (idempotent)."""

    def __init__(self, store: "ImageStore", count: int, nbytes: int):
        self._store = store
        self.count = count
        self.nbytes = nbytes

    def release(self) -> None:
        self._store._release(self)


class ImageStore:
    """Encoded images by file name (see the module docstring).

    Args:
        ttl_s: seconds each image stays available (> 0).
        max_images: cap on stored images.
        max_memory_bytes: cap on bytes kept in memory.
        spill_dir: folder for images beyond `max_memory_bytes` (created if missing; removed at
            `close` if this store created it); None keeps everything in memory.
        max_spill_bytes: cap on bytes in `spill_dir`.
        clock: monotonic clock in seconds (injectable for tests).
        shared: the folder `spill_dir` is shared with other stores (see the module docstring):
            every image goes there, names written by others are served too, nothing is deleted
            before it expires.
        wall_clock: seconds since the epoch (shared mode's expiry times; injectable for tests).

    Raises:
        ValueError: a non-positive ttl or cap, or `shared` without `spill_dir`.
    """

    def __init__(self, ttl_s: float = DEFAULT_TTL_S, max_images: int = DEFAULT_MAX_IMAGES,
                 max_memory_bytes: int = DEFAULT_MAX_BYTES, spill_dir: str | Path | None = None,
                 max_spill_bytes: int = DEFAULT_MAX_SPILL_BYTES, clock: Callable[[], float] = time.monotonic,
                 shared: bool = False, wall_clock: Callable[[], float] = time.time):
        if not ttl_s > 0 or max_images < 1 or max_memory_bytes < 1 or max_spill_bytes < 1:
            raise ValueError("ttl_s, max_images, max_memory_bytes and max_spill_bytes must be positive")
        if shared and spill_dir is None:
            raise ValueError("a shared store needs a folder (spill_dir)")
        self.shared = shared
        self._wall_clock = wall_clock
        self._next_sweep = -math.inf
        self.ttl_s = float(ttl_s)
        self.max_images = max_images
        self.max_memory_bytes = max_memory_bytes
        self.max_spill_bytes = max_spill_bytes if spill_dir is not None else 0
        self._clock = clock
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # oldest first
        self._memory_bytes = 0
        self._spill_bytes = 0
        self._reserved_count = 0
        self._reserved_bytes = 0
        self._lock = threading.Lock()
        self._spill_dir: Path | None = None
        self._created_dir = False
        if spill_dir is not None:
            path = Path(spill_dir).expanduser()
            self._created_dir = not path.exists() and not shared
            path.mkdir(parents=True, exist_ok=True)
            self._spill_dir = path if shared else Path(tempfile.mkdtemp(prefix="diffserve-images-", dir=path))

    @property
    def capacity_bytes(self) -> int:
        """Bytes the store can hold in all (memory plus spill folder; the folder alone when shared)."""
        return self.max_spill_bytes if self.shared else self.max_memory_bytes + self.max_spill_bytes

    def reserve(self, count: int, nbytes: int) -> Reservation:
        """Hold room for `count` images of at most `nbytes` bytes in all.

        Raises:
            StoreFullError: not enough room until some stored images expire.
            InvalidRequestError: never enough room: more images than the store holds (field
                ``n``) or more bytes (field ``response_format``); retrying cannot help.
        """
        if count > self.max_images:
            raise InvalidRequestError("n", count, f"at most {self.max_images} with response_format=url (the "
                                      "server's url image store holds that many; use response_format=b64_json)")
        if nbytes > self.capacity_bytes:
            raise InvalidRequestError("response_format", "url", f"b64_json: {count} url image(s) of up to {nbytes} "
                                      f"bytes exceed the server's url image store ({self.capacity_bytes} bytes)")
        with self._lock:
            self._evict_expired()
            used_count = len(self._entries) + self._reserved_count
            used_bytes = self._memory_bytes + self._spill_bytes + self._reserved_bytes
            if used_count + count > self.max_images or used_bytes + nbytes > self.capacity_bytes:
                retry = 1
                if self._entries:
                    oldest = next(iter(self._entries.values()))
                    retry = max(1, math.ceil(oldest.expires_at - self._clock()))
                raise StoreFullError(
                    "the url image store is full until earlier images expire; retry later or use "
                    "response_format=b64_json", retry_after_s=retry)
            self._reserved_count += count
            self._reserved_bytes += nbytes
            return Reservation(self, count, nbytes)

    def put(self, data: bytes, media_type: str, extension: str, reservation: Reservation) -> tuple[str, float]:
        """Store `data` in room held by `reservation`.

        Returns:
            (file name ``<random>.<extension>``, seconds from now until it expires).

        Raises:
            ValueError: the reservation has no image or not enough bytes left.
        """
        size = len(data)
        with self._lock:
            if reservation.count < 1 or size > reservation.nbytes:
                raise ValueError("image larger than its reservation")
            reservation.count -= 1
            reservation.nbytes -= size
            self._reserved_count -= 1
            self._reserved_bytes -= size
            self._evict_expired()
            name = f"{secrets.token_urlsafe(16)}.{extension}"
            if self.shared:
                path = self._write_shared(name, data)
                self._entries[name] = _Entry(media_type, size, self._clock() + self.ttl_s, path=path)
                self._spill_bytes += size
                return name, self.ttl_s
            self._entries[name] = _Entry(media_type, size, self._clock() + self.ttl_s, data=data)
            self._memory_bytes += size
            self._spill_oldest()
            return name, self.ttl_s

    def get(self, name: str) -> StoredImage | None:
        """The image stored under `name` (in shared mode: by any store on the folder), or None
        if unknown or expired."""
        with self._lock:
            self._evict_expired()
            entry = self._entries.get(name)
            if entry is None:
                return self._get_shared(name) if self.shared else None
            data = entry.data
            if data is None:
                try:
                    data = entry.path.read_bytes()  # type: ignore[union-attr]
                except OSError:
                    return None
            return StoredImage(data, entry.media_type, entry.expires_at)

    def __len__(self) -> int:
        with self._lock:
            self._evict_expired()
            return len(self._entries)

    def stats(self) -> dict[str, int]:
        """Counts: images, memory_bytes, spilled_bytes, reserved_images, reserved_bytes."""
        with self._lock:
            self._evict_expired()
            return {"images": len(self._entries), "memory_bytes": self._memory_bytes,
                    "spilled_bytes": self._spill_bytes, "reserved_images": self._reserved_count,
                    "reserved_bytes": self._reserved_bytes}

    def close(self) -> None:
        """Forget every image and delete the spill folder's files (shared mode: forget them
        only; they stay in the folder, served by the other stores, until they expire)."""
        with self._lock:
            self._entries.clear()
            self._memory_bytes = self._spill_bytes = 0
            if self._spill_dir is not None and not self.shared:
                shutil.rmtree(self._spill_dir, ignore_errors=True)
                if self._created_dir:
                    try:
                        self._spill_dir.parent.rmdir()
                    except OSError:
                        pass

    # ------------------------------------------------------------------------- internals
    def _release(self, reservation: Reservation) -> None:
        with self._lock:
            self._reserved_count -= reservation.count
            self._reserved_bytes -= reservation.nbytes
            reservation.count = reservation.nbytes = 0

    def _spill_oldest(self) -> None:
        """Move the oldest in-memory images to the spill folder while memory is over its cap
        (room there is guaranteed by the reservations)."""
        if self._memory_bytes <= self.max_memory_bytes or self._spill_dir is None:
            return
        for name, entry in self._entries.items():
            if self._memory_bytes <= self.max_memory_bytes:
                break
            if entry.data is None:
                continue
            path = self._spill_dir / name
            path.write_bytes(entry.data)
            entry.path, entry.data = path, None
            self._memory_bytes -= entry.size
            self._spill_bytes += entry.size

    def _write_shared(self, name: str, data: bytes) -> Path:
        """Write `data` as `name` in the shared folder, atomically, its mtime its expiry time.

        Raises:
            OSError: the folder cannot be written (nothing is left behind).
        """
        path = self._spill_dir / name  # type: ignore[operator]
        temporary = path.with_name(f".{name}.tmp")
        try:
            temporary.write_bytes(data)
            expires = self._wall_clock() + self.ttl_s
            os.utime(temporary, (expires, expires))
            os.replace(temporary, path)
        except OSError:
            temporary.unlink(missing_ok=True)
            raise
        return path

    def _get_shared(self, name: str) -> StoredImage | None:
        """An image another store wrote to the shared folder, until its mtime (expiry) passes."""
        if not _NAME.fullmatch(name):  # a stored name, never a path
            return None
        path = self._spill_dir / name  # type: ignore[operator]
        try:
            expires = path.stat().st_mtime
            if expires <= self._wall_clock():
                return None
            data = path.read_bytes()
        except OSError:
            return None
        extension = name.rsplit(".", 1)[1]
        return StoredImage(data, MEDIA_TYPES[extension], self._clock() + expires - self._wall_clock())

    def _sweep_shared(self) -> None:
        """Delete the shared folder's expired images, whoever wrote them (a writer that died
        leaves its files behind), and temporary files older than a ttl."""
        now = self._wall_clock()
        try:
            items = list(os.scandir(self._spill_dir))  # type: ignore[arg-type]
        except OSError:  # the folder is unreachable for now
            return
        for item in items:
            if _NAME.fullmatch(item.name):
                deadline = now
            elif _TEMPORARY.fullmatch(item.name):
                deadline = now - self.ttl_s  # never a write in progress
            else:
                continue
            try:
                if item.stat().st_mtime <= deadline:
                    os.unlink(item.path)
            except OSError:  # removed by another store meanwhile
                pass

    def _evict_expired(self) -> None:
        if self.shared and self._clock() >= self._next_sweep:
            self._next_sweep = self._clock() + min(SWEEP_INTERVAL_S, self.ttl_s)
            self._sweep_shared()
        now = self._clock()
        while self._entries:
            name, entry = next(iter(self._entries.items()))
            if entry.expires_at > now:
                break
            del self._entries[name]
            if entry.data is None:
                self._spill_bytes -= entry.size
                if entry.path is not None:
                    entry.path.unlink(missing_ok=True)
            else:
                self._memory_bytes -= entry.size
