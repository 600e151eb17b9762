"""Sleep-mode endpoints of the OpenAI-compatible server (vLLM's names and semantics).

    POST /sleep?level=1|2   stop admitting, let in-flight requests finish, then put the engine
                            to sleep (level 1: weights off the device; level 2: discarded,
                            reloaded from the model folder on wake); answers once asleep:
                            ``{"is_sleeping": true, "level": N}``
    POST /wake_up           restore the weights and admit requests again:
                            ``{"is_sleeping": false}``
    GET  /is_sleeping       ``{"is_sleeping": bool}``

While the engine is asleep or going to sleep, generation requests (``POST /v1/...``) get a 503
``service_unavailable`` / ``engine_sleeping`` error in OpenAI's format with ``Retry-After``;
with ``wake_on_request`` they wake the engine instead (waiting for a sleep in progress to
finish first) and then run. A bad ``level`` is a 400 naming ``level``; the endpoints answer 503
while the model is loading or the server is shutting down.

The routes are served only with ``--enable-sleep-mode`` (as vLLM serves them only in its
development mode): a client that may generate must not be able to stop the server for every
other client. With ``--api-key`` the two POST routes need the key like ``/v1/*``, and a page of
another site cannot post them (403).

`install_sleep_routes` adds all of this to an app built by
`diffserve.entrypoints.openai.app.create_app` (or any app whose state object has the
engine as ``engine`` and, optionally, ``require_service()``).
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from diffserve.core.errors import EngineSleepingError
from diffserve.core.sleep_levels import SLEEP_LEVELS
from diffserve.entrypoints.openai.errors import APIError, unavailable
from diffserve.entrypoints.openai.protocol import ErrorResponse
from diffserve.entrypoints.openai.request_body import check_form_origin

#: Path prefix of the requests the sleep gate holds back.
GATED_PREFIX = "/v1/"
#: The routes that change the engine's state: behind ``--api-key`` like ``/v1/*``, and refused
#: to other sites' pages (a body-less POST needs no CORS preflight).
CONTROL_PATHS = frozenset({"/sleep", "/wake_up"})


def _loaded_engine(state: Any) -> Any:
    """The server's engine.

    Raises:
        APIError: 503 while the model is loading, after a failed load, or while shutting down.
    """
    require = getattr(state, "require_service", None)
    if require is not None:
        require()
    engine = getattr(state, "engine", None)
    if engine is None:
        raise unavailable("the model is still loading; retry shortly", "model_loading")
    return engine


def sleeping_error(state_name: str) -> APIError:
    """503 with ``Retry-After`` for a request that arrives while the engine sleeps."""
    what = "asleep" if state_name == "asleep" else "going to sleep"
    return unavailable(f"the engine is {what} (POST /wake_up wakes it); retry later", "engine_sleeping")


class _SleepGate:
    """ASGI middleware: generation requests while the engine sleeps get a 503 (or wake it,
    with ``wake_on_request``)."""

    def __init__(self, app, state: Any, wake_on_request: bool):
        self.app = app
        self.state = state
        self.wake_on_request = wake_on_request

    async def __call__(self, scope, receive, send):
        engine = getattr(self.state, "engine", None)
        if (scope["type"] == "http" and scope["method"] == "POST" and scope["path"].startswith(GATED_PREFIX)
                and engine is not None):
            sleep_state = engine.sleep_state
            if sleep_state != "awake":
                if not self.wake_on_request:
                    await sleeping_error(sleep_state).to_response()(scope, receive, send)
                    return
                await asyncio.get_running_loop().run_in_executor(None, engine.wake_up)
        await self.app(scope, receive, send)


class SleepState(BaseModel):
    """Response of the sleep routes: whether the engine sleeps, and at which level (``POST /sleep``)."""

    is_sleeping: bool
    level: int | None = None


def install_sleep_routes(app: FastAPI, state: Any, wake_on_request: bool = False,
                         allowed_origins: list[str] | None = None, public_url: str | None = None,
                         routes: bool = True) -> None:
    """Add the sleep gate on ``POST /v1/...``, a 503 handler for `EngineSleepingError` and,
    with `routes`, ``/sleep``, ``/wake_up`` and ``/is_sleeping`` to `app` (call before the app
    starts).

    Args:
        app: the FastAPI app (its OpenAI error handlers installed, see
            `diffserve.entrypoints.openai.errors.install_error_handlers`).
        state: the server state; ``state.engine`` is the engine client (None while
            loading).
        wake_on_request: a generation request wakes a sleeping engine instead of getting 503.
        allowed_origins, public_url: the sites whose pages may post ``/sleep`` and ``/wake_up``
            besides the server's own (others get 403 ``cross_origin_forbidden``, see
            `request_body.check_form_origin`); the API key, when set, is checked by the
            server's auth middleware (`CONTROL_PATHS`).
        routes: serve the three routes (``--enable-sleep-mode``); without them the engine can
            still be put to sleep in process (`DiffusionEngine.sleep`), and the gate answers
            for it.
    """

    app.add_middleware(_SleepGate, state=state, wake_on_request=wake_on_request)

    @app.exception_handler(EngineSleepingError)
    async def _sleeping(request: Request, exc: EngineSleepingError) -> JSONResponse:
        engine = getattr(state, "engine", None)
        name = engine.sleep_state if engine is not None else "asleep"
        return sleeping_error(name).to_response()

    if not routes:
        return
    error = {"model": ErrorResponse}
    control = {403: {**error, "description": "Posted by a page of another site"},
               503: {**error, "description": "The model is loading, failed to load, or the server is shutting down"}}

    @app.post("/sleep", response_model=SleepState, responses={400: {**error, "description": "Invalid level"},
                                                               **control})
    async def sleep(request: Request, level: int = Query(1, ge=min(SLEEP_LEVELS), le=max(SLEEP_LEVELS),
                                                         description="1: weights off the device; 2: discarded, "
                                                                     "reloaded from the model folder on wake")
                    ) -> JSONResponse:
        """Drain, then sleep at `level` (1 or 2); answers once asleep."""
        check_form_origin(request, allowed_origins, public_url)
        engine = _loaded_engine(state)
        from diffserve.core.sleep_levels import check_level

        level = check_level(level)
        await asyncio.get_running_loop().run_in_executor(None, engine.sleep, level)
        return JSONResponse({"is_sleeping": True, "level": engine.sleep_level})

    @app.post("/wake_up", response_model=SleepState, responses=control)
    async def wake_up(request: Request) -> JSONResponse:
        """Restore the weights; answers once awake."""
        check_form_origin(request, allowed_origins, public_url)
        engine = _loaded_engine(state)
        await asyncio.get_running_loop().run_in_executor(None, engine.wake_up)
        return JSONResponse({"is_sleeping": engine.is_sleeping})

    @app.get("/is_sleeping", response_model=SleepState, responses={503: control[503]})
    async def is_sleeping() -> JSONResponse:
        """Whether the engine is asleep."""
        engine = _loaded_engine(state)
        return JSONResponse({"is_sleeping": engine.is_sleeping})
