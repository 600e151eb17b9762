"""ASGI middleware of the HTTP server: generation requests counted by final status
(`StatusCounter`, for the metrics) and API-key authentication (`ApiKeyAuth`, ``--api-key``)."""

from __future__ import annotations

import secrets
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

    def _protected(self, path: str) -> bool:
        if self.protect_all:
            return True
        if path in self.control_paths:
            return True
        return (path == "/v1" or path.startswith("/v1/")) and not path.startswith(self.links_prefix)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or not self._protected(scope["path"]):
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
