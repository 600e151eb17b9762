"""The HTTP/1.1 connection protocol of ``diffserve serve``: uvicorn's h11 protocol plus the
connection-level guards uvicorn lacks.

uvicorn (0.30-0.59, h11 backend) times out only idle keep-alive connections *after* a response
(``timeout_keep_alive``): a connection that sends nothing, or half a request line, or headers
without the end of the body, is kept forever, and there is no bound on open connections
(``limit_concurrency`` answers 503 only once a request's headers are complete). Here:

- **Header timeout**: the request line and headers must arrive within
  `ConnectionLimits.header_timeout_s` seconds of the connection opening (or of the first byte
  of the next request on a kept-alive connection). A connection that sent nothing is closed
  silently; one that sent part of a request gets ``408`` (OpenAI error format) and is closed.
- **Body timeout**: the whole body must arrive within `ConnectionLimits.body_timeout_s`
  seconds of the headers (a total deadline, so a client trickling a byte at a time cannot keep
  it open); then ``408`` and close. The route sees a disconnect (``diffserve.body_timeout`` is
  set in its ASGI scope).
- **Connection limit**: past `ConnectionLimits.max_connections` open connections a new one is
  answered ``503`` with ``Retry-After`` and closed, so kept connections keep answering. The
  refusal half-closes first and discards what the client sends for up to `REFUSAL_LINGER_S`
  seconds, so the client reads the 503 instead of a reset. Which connections are served or
  refused, and how many are accepted at all (the bound on descriptors), is decided where they
  are accepted: `diffserve.entrypoints.openai.acceptor`.
- **Half-closed clients**: a client that sent a complete request and then shut down its
  sending side (``shutdown(SHUT_WR)``) still gets its full response (then the connection is
  closed); uvicorn treats that EOF as a disconnect. An EOF in the middle of a request, or a
  reset, is still a disconnect. TCP cannot tell a half-close from a full close until the
  server writes (a closed client's kernel answers data with a reset), so after such an EOF
  the connection is probed: before the response starts with two ``100 Continue`` interim
  responses `EOF_PROBE_DELAY_S` apart (clients skip 1xx responses, RFC 9110 section 15.2); a
  client that really went away makes the second write fail, which is a disconnect (its
  request is aborted). Once a response streams, ``CLIENT_EOF_KEY`` in the ASGI scope tells the
  route to probe with its own writes (the SSE route sends keep-alive comments).
- **Bounded logging**: connection-level messages (timeouts, refused connections, failed
  accepts, uvicorn's ``Invalid HTTP request received.``) are rate-limited per message: at most one line per
  `LOG_INTERVAL_S` seconds, the next one saying how many were suppressed. No traceback is
  logged for a dropped connection.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, ClassVar

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)

#: ASGI scope key set on a request whose body did not arrive within the body timeout.
BODY_TIMEOUT_KEY = "diffserve.body_timeout"
#: ASGI scope key set when the client closed its sending side after a complete request.
CLIENT_EOF_KEY = "diffserve.client_eof"
#: Seconds between the two ``100 Continue`` probes after a client's EOF.
EOF_PROBE_DELAY_S = 0.2
#: Seconds between two log lines of the same connection-level message.
LOG_INTERVAL_S = 10.0
#: Seconds a refused connection is kept half-closed so its client can read the 503.
REFUSAL_LINGER_S = 1.0


@dataclass(frozen=True)
class ConnectionLimits:
    """Connection-level limits of the HTTP server.

    Attributes:
        max_connections: most open connections; more are answered 503 and closed.
        header_timeout_s: seconds for the request line and headers to arrive.
        body_timeout_s: seconds for the whole request body to arrive after the headers.
        keep_alive_timeout_s: seconds an idle connection is kept after a response (uvicorn's
            ``timeout_keep_alive``).
    """

    max_connections: int = 512
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    keep_alive_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if not (isinstance(self.max_connections, int) and self.max_connections >= 1):
            raise ValueError("max_connections must be an integer >= 1")
        for name in ("header_timeout_s", "body_timeout_s", "keep_alive_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds")


class RateLimitedLogger:
    """A `logging.Logger` stand-in that lets each message template through at most once per
    `interval_s` seconds; the next line that gets through says how many were suppressed.
    Thread-safe. Other attributes are the wrapped logger's."""

    def __init__(self, wrapped: logging.Logger, interval_s: float = LOG_INTERVAL_S):
        self._wrapped = wrapped
        self._interval_s = interval_s
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._wrapped, name)

    def log(self, level: int, msg: str, *args: Any, **kwargs: Any) -> None:
        if not self._wrapped.isEnabledFor(level):
            return
        now = time.monotonic()
        with self._lock:
            last = self._last.get(msg)
            if last is not None and now - last < self._interval_s:
                self._suppressed[msg] = self._suppressed.get(msg, 0) + 1
                return
            self._last[msg] = now
            suppressed = self._suppressed.pop(msg, 0)
        if suppressed:
            msg = f"{msg} (and {suppressed} more like it in the last {self._interval_s:g}s)"
        self._wrapped.log(level, msg, *args, **kwargs)

    def reset(self) -> None:
        """Forget which messages were logged when (the next of each gets through)."""
        with self._lock:
            self._last.clear()
            self._suppressed.clear()

    def debug(self, msg: str, *args: Any, **kwargs: Any) -> None:
        self.log(logging.DEBUG, msg, *args, **kwargs)

    def info(self, msg: str, *args: Any, **kwargs: Any) -> None:
        self.log(logging.INFO, msg, *args, **kwargs)

    def warning(self, msg: str, *args: Any, **kwargs: Any) -> None:
        self.log(logging.WARNING, msg, *args, **kwargs)

    def error(self, msg: str, *args: Any, **kwargs: Any) -> None:
        self.log(logging.ERROR, msg, *args, **kwargs)


#: Connection-level messages of every server of the process (timeouts, refusals, failed accepts).
connection_log = RateLimitedLogger(logger)
#: uvicorn's own connection-level log, shared by every connection so the limit is per server.
_uvicorn_log = RateLimitedLogger(logging.getLogger("uvicorn.error"))


def _raw_error_response(status: int, reason: str, message: str, code: str, retry_after: int | None = None) -> bytes:
    """A complete HTTP/1.1 response with an OpenAI-format JSON error body and ``Connection: close``."""
    kind = "invalid_request_error" if status < 500 else "service_unavailable"
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()
    headers = [f"HTTP/1.1 {status} {reason}", "content-type: application/json",
               f"content-length: {len(body)}", "connection: close"]
    if retry_after is not None:
        headers.append(f"retry-after: {retry_after}")
    return ("\r\n".join(headers) + "\r\n\r\n").encode("latin-1") + body


class GuardedH11Protocol(H11Protocol):
    """uvicorn's `H11Protocol` with the guards of the module docstring; its limits come from
    the class attribute `limits` (see `protocol_class`). Its connections are accepted by a
    `diffserve.entrypoints.openai.acceptor.ConnectionAcceptor`, which attaches each protocol's
    slot (`attach_slot`) and decides whether it is served or refused."""

    limits: ClassVar[ConnectionLimits] = ConnectionLimits()

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.logger = _uvicorn_log  # type: ignore[assignment]
        self._timer: asyncio.TimerHandle | None = None
        self._timer_kind: str | None = None
        self._watched_cycle: Any = None
        self._pending_bytes = False  # bytes of a request whose headers are not complete yet
        self._slot: Any = None

    def attach_slot(self, slot: Any) -> None:
        """Take the acceptor's `slot` for this connection (released when it is lost); a slot
        with ``refused`` set makes this connection a refusal."""
        self._slot = slot

    @property
    def _refused(self) -> bool:
        return self._slot is not None and self._slot.refused

    # ------------------------------------------------------------------- asyncio protocol
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if self._refused:
            transport.write(_raw_error_response(
                503, "Service Unavailable",
                f"the server has {self.limits.max_connections} open connections, its limit (--max-connections); "
                "retry later", "too_many_connections", retry_after=1))
            if transport.can_write_eof():
                transport.write_eof()  # FIN after the 503; read and drop what the client still sends
                self.loop.call_later(REFUSAL_LINGER_S, transport.close)
            else:
                transport.close()
            connection_log.warning("refused a connection: %d connections open (--max-connections %d)",
                                   self._slot.open_at_accept,
                                   self.limits.max_connections)
            return
        super().connection_made(transport)
        self._arm("header", self.limits.header_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        try:
            if not self._refused:
                super().connection_lost(exc)
        finally:
            if self._slot is not None:
                self._slot.release()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        super().data_received(data)
        if not self._in_request():
            self._pending_bytes = True
        self._update_deadline()

    def eof_received(self) -> bool | None:
        if self._refused:
            return None
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete and not cycle.more_body and not cycle.disconnected:
            # Half-close (or a full close) after a complete request: answer it, then close.
            cycle.keep_alive = False
            cycle.scope[CLIENT_EOF_KEY] = True  # type: ignore[typeddict-unknown-key]
            self._probe(cycle)
            self.loop.call_later(EOF_PROBE_DELAY_S, self._probe, cycle)
            return True  # keep the transport open for writing
        return None  # idle or mid-request: the transport closes (a disconnect)

    def _probe(self, cycle: Any) -> None:
        """Write a ``100 Continue`` interim response while the final one has not started; a
        write to a client that closed fails and ends the connection (a disconnect)."""
        if cycle is not self.cycle or cycle.disconnected or cycle.response_started or self.transport.is_closing():
            return
        try:
            self.transport.write(self.conn.send(h11.InformationalResponse(status_code=100, headers=[],
                                                                          reason=b"Continue")))
        except h11.LocalProtocolError:
            pass

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._update_deadline()

    # -------------------------------------------------------------------------- deadlines
    def _in_request(self) -> bool:
        """Headers of a request were received and its response is not complete."""
        return self.cycle is not None and not self.cycle.response_complete

    def _update_deadline(self) -> None:
        cycle = self.cycle
        if self._in_request():
            if cycle is not self._watched_cycle:  # the headers of a new request arrived
                self._watched_cycle = cycle
                self._pending_bytes = False
                self._disarm()
                if cycle.more_body:
                    self._arm("body", self.limits.body_timeout_s)
            elif self._timer_kind == "body" and not cycle.more_body:
                self._disarm()
        elif self._timer_kind == "body":
            self._disarm()  # answered before its body was read (the rest is discarded)
        if not self._in_request() and self._pending_bytes and self._timer_kind is None:
            self._arm("header", self.limits.header_timeout_s)  # part of the next request

    def _arm(self, kind: str, seconds: float) -> None:
        self._disarm()
        self._timer_kind = kind
        self._timer = self.loop.call_later(seconds, self._expired, kind)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = None
        self._timer_kind = None

    def _expired(self, kind: str) -> None:
        self._timer = None
        self._timer_kind = None
        if self.transport is None or self.transport.is_closing():
            return
        peer = "%s:%s" % self.client if self.client else "-"
        if kind == "header":
            if self._pending_bytes or self._in_request():
                self.transport.write(_raw_error_response(
                    408, "Request Timeout",
                    f"request headers not received within {self.limits.header_timeout_s:g}s",
                    "request_timeout"))
                connection_log.info("%s - closed: request headers not received within %gs", peer,
                                     self.limits.header_timeout_s)
        else:
            cycle = self.cycle
            if cycle is not None and not cycle.response_started:
                cycle.scope[BODY_TIMEOUT_KEY] = True  # type: ignore[typeddict-unknown-key]
                self.transport.write(_raw_error_response(
                    408, "Request Timeout",
                    f"request body not received within {self.limits.body_timeout_s:g}s", "request_timeout"))
            connection_log.info("%s - closed: request body not received within %gs", peer,
                                 self.limits.body_timeout_s)
        self.transport.close()


def protocol_class(limits: ConnectionLimits) -> type[GuardedH11Protocol]:
    """A `GuardedH11Protocol` subclass using `limits`, for ``uvicorn.Config(http=...)``."""
    return type("DiffserveH11Protocol", (GuardedH11Protocol,), {"limits": limits})
