"""In-memory store of encoded images behind ``response_format="url"``.

Each image is kept for `ImageStore.ttl_s` seconds after it was generated, then forgotten; the
store also holds at most `max_images` images and `max_bytes` bytes, evicting the oldest first,
so a URL may stop working before its expiry under heavy use. Nothing is written to disk and a
restart forgets everything. File names are random (128 bits), so they act as capabilities: the
files endpoint needs no other authorisation.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

#: Default lifetime of a stored image, seconds.
DEFAULT_TTL_S = 3600.0
#: Default cap on stored images.
DEFAULT_MAX_IMAGES = 256
#: Default cap on stored bytes (256 MiB).
DEFAULT_MAX_BYTES = 256 * 2**20


@dataclass(frozen=True)
class StoredImage:
    """An encoded image and its media type; `expires_at` is on the store's clock (seconds)."""

    data: bytes
    media_type: str
    expires_at: float


class ImageStore:
    """Encoded images by file name, with a TTL and caps.

    Args:
        ttl_s: seconds each image stays available (> 0).
        max_images / max_bytes: caps; the oldest images are evicted to stay within them.
        clock: monotonic clock in seconds (injectable for tests).

    Raises:
        ValueError: a non-positive ttl or cap.
    """

    def __init__(self, ttl_s: float = DEFAULT_TTL_S, max_images: int = DEFAULT_MAX_IMAGES,
                 max_bytes: int = DEFAULT_MAX_BYTES, clock: Callable[[], float] = time.monotonic):
        if ttl_s <= 0 or max_images < 1 or max_bytes < 1:
            raise ValueError("ttl_s, max_images and max_bytes must be positive")
        self.ttl_s = float(ttl_s)
        self.max_images = max_images
        self.max_bytes = max_bytes
        self._clock = clock
        self._images: OrderedDict[str, StoredImage] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def put(self, data: bytes, media_type: str, extension: str) -> str:
        """Store `data`; returns its new file name ``<random>.<extension>``."""
        name = f"{secrets.token_urlsafe(16)}.{extension}"
        with self._lock:
            self._evict_expired()
            self._images[name] = StoredImage(data, media_type, self._clock() + self.ttl_s)
            self._bytes += len(data)
            while self._images and (len(self._images) > self.max_images or self._bytes > self.max_bytes):
                self._drop_oldest()
        return name

    def get(self, name: str) -> StoredImage | None:
        """The image stored under `name`, or None if unknown, expired or evicted."""
        with self._lock:
            self._evict_expired()
            return self._images.get(name)

    def __len__(self) -> int:
        with self._lock:
            self._evict_expired()
            return len(self._images)

    def _drop_oldest(self) -> None:
        _, image = self._images.popitem(last=False)
        self._bytes -= len(image.data)

    def _evict_expired(self) -> None:
        now = self._clock()
        while self._images:
            image = next(iter(self._images.values()))
            if image.expires_at > now:
                break
            self._drop_oldest()
