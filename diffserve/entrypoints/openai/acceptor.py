"""Accepting connections on the listening socket with a bound on the descriptors they hold.

asyncio's and uvloop's own servers accept every pending connection as fast as the kernel hands
them over, so a connection limit can only close the extra ones afterwards: a burst of
connections holds as many descriptors as the burst (asyncio) or as the loop's accept batches
(uvloop), and once the process's ``RLIMIT_NOFILE`` is reached every other open of the process
fails too, while asyncio logs a traceback per failed ``accept``. `ConnectionAcceptor` accepts
itself (a reader callback on the listening socket, the same code on both loops) and:

- serves at most `ConnectionLimits.max_connections` connections at once;
- past that, accepts at most `REFUSAL_MARGIN` more, each answered ``503`` with ``Retry-After``
  by the protocol (`diffserve.entrypoints.openai.http_protocol`) and closed within
  `diffserve.entrypoints.openai.http_protocol.REFUSAL_LINGER_S` seconds;
- with both full, stops accepting (removes its reader): further connections wait in the
  kernel's listen backlog, and accepting resumes as soon as one of the held connections closes.
  The descriptors held for connections never exceed ``max_connections + REFUSAL_MARGIN``.
- an ``accept`` that fails for lack of resources (``EMFILE``, ``ENFILE``, ``ENOBUFS``,
  ``ENOMEM``: descriptors the rest of the process holds, or the system's) pauses accepting for
  `ACCEPT_RETRY_S` seconds (or until a held connection closes), is counted in `ConnectionStats`
  (``diffserve_accept_errors_total`` in ``/metrics``) and logged at most once per
  `diffserve.entrypoints.openai.http_protocol.LOG_INTERVAL_S` seconds, without a traceback;
  an ``accept`` that fails for one connection only (the client reset it first) is counted and
  skipped.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import threading
from collections.abc import Callable
from typing import Any

from diffserve.entrypoints.openai.http_protocol import ConnectionLimits, connection_log

logger = logging.getLogger(__name__)

#: Most connections accepted only to be refused (503) that may be open at once.
REFUSAL_MARGIN = 32
#: Seconds accepting pauses after an ``accept`` failed for lack of resources.
ACCEPT_RETRY_S = 0.5
#: Most connections accepted per readiness callback (other callbacks run in between).
ACCEPT_BATCH = 64
#: ``accept`` errors that mean the process or system ran out of a resource (accepting pauses).
RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


class ConnectionStats:
    """Counters of the connections a server accepted, for ``/metrics`` (thread-safe reads of
    values written on the event loop).

    Attributes:
        open: connections held now (served and being refused).
        accepted: connections accepted (served or refused).
        refused: connections answered 503 because `ConnectionLimits.max_connections` were open.
        accept_errors: failed ``accept`` calls by errno name (``EMFILE``, ``ENFILE``, ...).
        paused: accepting is paused now (limit reached, or after a resource error).
    """

    def __init__(self) -> None:
        self.open = 0
        self.accepted = 0
        self.refused = 0
        self.accept_errors: dict[str, int] = {}
        self.paused = False
        self._lock = threading.Lock()

    def count_error(self, code: int | None) -> None:
        name = errno.errorcode.get(code, str(code)) if code is not None else "unknown"
        with self._lock:
            self.accept_errors[name] = self.accept_errors.get(name, 0) + 1

    def snapshot(self) -> dict[str, Any]:
        """The counters as a dict (``accept_errors`` copied)."""
        with self._lock:
            errors = dict(self.accept_errors)
        return {"open": self.open, "accepted": self.accepted, "refused": self.refused,
                "accept_errors": errors, "paused": self.paused}


class _Slot:
    """One accepted connection's share of the bound; `release` (idempotent) gives it back."""

    __slots__ = ("_acceptor", "refused", "open_at_accept", "_released")

    def __init__(self, acceptor: "ConnectionAcceptor", refused: bool, open_at_accept: int):
        self._acceptor = acceptor
        self.refused = refused
        self.open_at_accept = open_at_accept
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._acceptor._release(self)


class ConnectionAcceptor:
    """Accepts connections on a listening socket for `protocol_factory`'s protocols, within
    `limits` (see the module docstring). Used like an `asyncio.Server` by uvicorn's shutdown
    (`close`, `wait_closed`).

    Args:
        sock: a bound TCP socket (``listen`` is called here with `backlog`).
        protocol_factory: builds one protocol per connection; each gets
            ``attach_slot(slot)`` before its ``connection_made`` and must call
            ``slot.release()`` when its connection is lost (`GuardedH11Protocol` does).
        limits: `ConnectionLimits.max_connections` is the bound of served connections.
        stats: where the counters go.
        backlog: the kernel's listen backlog (connections that wait while accepting pauses).
    """

    def __init__(self, sock: socket.socket, protocol_factory: Callable[[], Any], limits: ConnectionLimits,
                 stats: ConnectionStats, backlog: int = 2048):
        self._sock = sock
        self._factory = protocol_factory
        self._limits = limits
        self.stats = stats
        self._backlog = backlog
        self._loop: asyncio.AbstractEventLoop | None = None
        self._served = 0
        self._refusing = 0
        self._reading = False
        self._closed = False
        self._retry: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task] = set()

    # ---------------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Start listening and accepting on the running event loop."""
        self._loop = asyncio.get_running_loop()
        self._sock.setblocking(False)
        self._sock.listen(self._backlog)
        self._resume()

    def close(self) -> None:
        """Stop accepting (the listening socket itself is closed by its owner)."""
        self._closed = True
        self._pause()
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None

    async def wait_closed(self) -> None:
        """Wait for connections still being set up."""
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    @property
    def sockets(self) -> tuple[socket.socket, ...]:
        return (self._sock,)

    # ----------------------------------------------------------------------- accepting
    def _pause(self) -> None:
        if self._reading and self._loop is not None:
            self._loop.remove_reader(self._sock.fileno())
            self._reading = False
        self.stats.paused = True

    def _resume(self) -> None:
        if self._closed or self._retry is not None:
            return
        if not self._reading:
            self._loop.add_reader(self._sock.fileno(), self._accept)
            self._reading = True
        self.stats.paused = False

    def _has_room(self) -> bool:
        return self._served < self._limits.max_connections or self._refusing < REFUSAL_MARGIN

    def _accept(self) -> None:
        for _ in range(ACCEPT_BATCH):
            if not self._has_room():
                self._pause()  # the backlog holds the rest until a connection closes
                return
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self.stats.count_error(exc.errno)
                if exc.errno in RESOURCE_ERRNOS:
                    self._pause_after_error(exc)
                    return
                connection_log.info("accept failed for one connection: %s", _reason(exc))
                continue
            self._admit(conn)

    def _pause_after_error(self, exc: OSError) -> None:
        self._pause()
        self._retry = self._loop.call_later(ACCEPT_RETRY_S, self._retry_accept)
        connection_log.warning(
            "cannot accept connections: %s (%d held for connections, --max-connections %d); accepting paused "
            "for %gs, new connections wait in the listen backlog", _reason(exc), self._served + self._refusing,
            self._limits.max_connections, ACCEPT_RETRY_S)

    def _retry_accept(self) -> None:
        self._retry = None
        self._resume()

    def _admit(self, conn: socket.socket) -> None:
        refused = self._served >= self._limits.max_connections
        if refused:
            self._refusing += 1
            self.stats.refused += 1
        else:
            self._served += 1
        self.stats.accepted += 1
        self.stats.open = self._served + self._refusing
        slot = _Slot(self, refused, self.stats.open)
        conn.setblocking(False)
        task = self._loop.create_task(self._connect(conn, slot))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _connect(self, conn: socket.socket, slot: _Slot) -> None:
        def factory():
            protocol = self._factory()
            protocol.attach_slot(slot)
            return protocol

        try:
            await self._loop.connect_accepted_socket(factory, conn)
        except Exception as exc:  # noqa: BLE001 - e.g. the client reset before the transport was set up
            conn.close()
            slot.release()
            connection_log.info("dropped a connection while setting it up: %s", _reason(exc))

    def _release(self, slot: _Slot) -> None:
        if slot.refused:
            self._refusing -= 1
        else:
            self._served -= 1
        self.stats.open = self._served + self._refusing
        if self._retry is not None:  # a descriptor was freed: try again now
            self._retry.cancel()
            self._retry = None
        if not self._reading and self._has_room():
            self._resume()


def _reason(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.errno is not None:
        return f"[{errno.errorcode.get(exc.errno, exc.errno)}] {exc.strerror or exc}"
    return f"{type(exc).__name__}: {exc}"
