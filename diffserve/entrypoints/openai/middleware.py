"""ASGI middleware of the HTTP server: generation requests counted by final status
(`StatusCounter`, for the metrics), API-key authentication (`ApiKeyAuth`, ``--api-key``), the
``Host`` allow-list (`HostAllowList`, ``--allowed-hosts``) and the routes of capabilities the
loaded model lacks (`CapabilityGate`)."""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import TYPE_CHECKING

from diffserve.entrypoints.openai.errors import CLIENT_CLOSED_REQUEST, APIError
from diffserve.entrypoints.openai.request_body import CLIENT_DISCONNECTED_KEY
from diffserve.entrypoints.openai.http_protocol import BODY_TIMEOUT_KEY

if TYPE_CHECKING:
    from diffserve.entrypoints.openai.ops.metrics import ServerMetrics


class StatusCounter:
    """ASGI middleware counting generation requests (``POST`` to `paths`) by final status (408
    when the body read timed out, 499 when the client disconnected before its response)."""

    def __init__(self, app, metrics: ServerMetrics, paths: frozenset[str]):
        self.app = app
        self.metrics = metrics
        self.paths = paths

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in self.paths:
            await self.app(scope, receive, send)
            return
        status: int | None = None

        async def send_and_record(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_record)
        except BaseException:
            status = status or 500
            raise
        finally:
            if scope.get(BODY_TIMEOUT_KEY):
                status = 408
            elif scope.get(CLIENT_DISCONNECTED_KEY) or status is None:
                status = CLIENT_CLOSED_REQUEST
            self.metrics.observe_status(status)


class ApiKeyAuth:
    """ASGI middleware: ``Authorization: Bearer KEY`` on ``/v1/*`` and the engine controls
    (`control_paths`: ``POST /sleep``, ``POST /wake_up``) (every path when `protect_all`), except
    the capability links under `links_prefix` (``/v1/images/files/``) unless `protect_all`; 401
    in OpenAI's format otherwise. CORS preflights (OPTIONS) pass (the CORS middleware, outside
    this one, answers them)."""

    def __init__(self, app, api_key: str, control_paths: frozenset[str], links_prefix: str,
                 protect_all: bool = False):
        self.app = app
        self._expected = f"Bearer {api_key}".encode()
        self.control_paths = control_paths
        self.links_prefix = links_prefix
        self.protect_all = protect_all

    def protects(self, path: str) -> bool:
        """Whether a request to `path` needs the key."""
        if self.protect_all:
            return True
        if path in self.control_paths:
            return True
        return (path == "/v1" or path.startswith("/v1/")) and not path.startswith(self.links_prefix)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or not self.protects(scope["path"]):
            await self.app(scope, receive, send)
            return
        given = next((value for name, value in scope["headers"] if name == b"authorization"), None)
        if given is not None and secrets.compare_digest(given, self._expected):
            await self.app(scope, receive, send)
            return
        if given is None:
            message = ("You didn't provide an API key. You need to provide your API key in an Authorization "
                       "header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).")
        else:
            message = "Incorrect API key provided."
        error = APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        await error.to_response()(scope, receive, send)


def host_name(host_header: str) -> str:
    """The name or address of a ``Host`` header value, without the port, lower case
    (``"[::1]:8000"`` -> ``"::1"``, ``"Example.COM:80"`` -> ``"example.com"``)."""
    host = host_header.strip().lower()
    if host.startswith("["):  # an IPv6 literal
        return host[1:host.find("]")] if "]" in host else host[1:]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


class HostAllowList:
    """ASGI middleware: answer only requests whose ``Host`` header names one of
    `allowed_hosts` (any port; ``.example.com`` also matches its subdomains); others get 400
    ``invalid_host`` in OpenAI's format. A browser page whose site name was re-pointed at this
    server's address (DNS rebinding) sends its own name as ``Host``, so it is refused before
    any route (or the same-origin check of form posts) sees it. A request without ``Host``
    (HTTP/1.0; browsers always send it) passes."""

    def __init__(self, app, allowed_hosts: list[str]):
        self.app = app
        self.names = frozenset(h.lower().strip("[]") for h in allowed_hosts if not h.startswith("."))
        self.suffixes = tuple(h.lower() for h in allowed_hosts if h.startswith("."))

    def allows(self, host_header: str) -> bool:
        """Whether a request with this ``Host`` header value is answered."""
        name = host_name(host_header)
        return name in self.names or any(name.endswith(s) or name == s[1:] for s in self.suffixes)

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        host = next((value for name, value in scope["headers"] if name == b"host"), None)
        if host is None or self.allows(host.decode("latin-1")):
            await self.app(scope, receive, send)
            return
        shown = host.decode("latin-1")[:100]
        error = APIError(400, f"Invalid Host header {shown!r}: this server answers only to "
                              f"{', '.join(sorted(self.names) + list(self.suffixes))} (--allowed-hosts).",
                         code="invalid_host")
        await error.to_response()(scope, receive, send)


class CapabilityGate:
    """ASGI middleware: a request whose path a capability serves (`capability_of`, e.g.
    ``/v1/videos/...`` -> ``text-to-video``) that the loaded model lacks gets 404
    ``unsupported_endpoint`` in OpenAI's format (`message`), whatever its method; the served
    OpenAPI schema leaves those paths out too. `served` returns the loaded model's capabilities
    (None while it loads: every route answers, with 503 where it needs the model)."""

    def __init__(self, app, capability_of: Callable[[str], "str | None"], served: Callable[[], "set[str] | None"],
                 message: Callable[[str, str], str]):
        self.app = app
        self.capability_of = capability_of
        self.served = served
        self.message = message

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            capability = self.capability_of(scope["path"])
            served = self.served() if capability is not None else None
            if served is not None and capability not in served:
                error = APIError(404, self.message(scope["path"], capability), code="unsupported_endpoint")
                await error.to_response()(scope, receive, send)
                return
        await self.app(scope, receive, send)
