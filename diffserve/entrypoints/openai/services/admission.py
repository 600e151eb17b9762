"""Fair admission when the waiting queue is full: a client that retries after ``Retry-After``
is not starved by others that happen to arrive when room frees.

Without it, room that frees goes to whichever request arrives first, so one client retrying
every second can lose to fresh requests indefinitely (a hostile trial measured 176 attempts,
~45 s, for one client while others got through). The rule (`AdmissionLine`):

1. A request the waiting queue has no room for is answered 429 with ``Retry-After`` and put in
   a line, first refused first, under its fingerprint (`request_fingerprint`: the client's
   address, the route and the request's validated content, so the retry of the same request
   that OpenAI's clients send has the same fingerprint; a request already in the line keeps
   its place).
2. Room that frees is held for the requests at the head of the line, in that order (a head that
   needs more rows than are free holds all the free room until enough is free). A request in
   the line takes its held room when it comes back; any other request is admitted only into
   room beyond what is held.
3. A request that holds room and whose client has not come back for `HOLD_S` seconds (since
   the room was held, or since its last retry), or that was not retried for `LINE_TTL_S`
   seconds, leaves the line (its client gave up); the line holds at most `MAX_LINE` requests
   (later ones are refused without a place).

So a client that retries within `HOLD_S` seconds of each ``Retry-After`` waits at most for the
requests refused before it. Everything runs on the server's event loop (no locking).
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from diffserve.entrypoints.openai.errors import RETRY_AFTER_S

#: Seconds room stays held for a request at the head of the line (its client retries after
#: ``Retry-After`` = `RETRY_AFTER_S` seconds, plus slack for a slow client).
HOLD_S = RETRY_AFTER_S + 2.0
#: Seconds a request stays in the line without being retried.
LINE_TTL_S = 10.0
#: Most requests in the line.
MAX_LINE = 1024


@dataclass
class _Entry:
    rows: int
    last_seen: float
    held_since: float | None = None


class AdmissionLine:
    """The line of refused requests and the room held for them (see the module docstring).

    Args:
        clock: monotonic seconds (injectable for tests).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._line: OrderedDict[str, _Entry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._line)

    def admit(self, fingerprint: str | None, rows: int, free: int) -> bool:
        """Whether a request that needs `rows` of the waiting queue's `free` room may be queued
        now. False: refuse it (429); it was put in the line (or kept its place there).

        Args:
            fingerprint: `request_fingerprint` of the request (None: not tracked, admitted
                only into room nobody in the line is owed).
            rows: queue entries the request needs (one per image).
            free: free room of the waiting queue now (may be <= 0).
        """
        now = self._clock()
        self._expire(now)
        held = 0
        mine: _Entry | None = None
        for key, entry in self._line.items():
            if held + entry.rows > free:
                if held < free and entry.held_since is None:
                    entry.held_since = now
                held = max(held, free)  # the head that does not fit yet keeps what is free
                break
            held += entry.rows
            if entry.held_since is None:
                entry.held_since = now
            if key == fingerprint:
                mine = entry
        if mine is not None or (free - held >= rows):
            if fingerprint is not None:
                self._line.pop(fingerprint, None)
            return True
        if fingerprint is not None:
            entry = self._line.get(fingerprint)
            if entry is not None:
                entry.last_seen = now
                entry.rows = rows
            elif len(self._line) < MAX_LINE:
                self._line[fingerprint] = _Entry(rows, now)
        return False

    def _expire(self, now: float) -> None:
        gone = [key for key, e in self._line.items()
                if now - e.last_seen > LINE_TTL_S
                or (e.held_since is not None and now - max(e.held_since, e.last_seen) > HOLD_S)]
        for key in gone:
            del self._line[key]


def request_fingerprint(client_host: str | None, route: str, content: str, blobs: Iterable[bytes] = ()) -> str:
    """The identity of a request in the line: SHA-256 of the client's address, the route, the
    request's canonical content (e.g. the validated body as JSON) and any uploaded `blobs`
    (input images), so a client's retry of the same request matches whatever its transport
    encoding (a new multipart boundary, key order)."""
    digest = hashlib.sha256(f"{client_host}\0{route}\0{content}".encode())
    for blob in blobs:
        digest.update(hashlib.sha256(blob).digest())
    return digest.hexdigest()
