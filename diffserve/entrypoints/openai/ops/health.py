"""``GET /health``: 200 ``{"status": "ok", "model": NAME}`` once the model is loaded and requests
are admitted; 503 in OpenAI's error format while loading, after a failed load, while shutting
down and when the engine loop died (the reasons of `ServerState.require_service`)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from diffserve.entrypoints.openai.protocol import ErrorResponse


def install_health_route(app: FastAPI, state: Any) -> None:
    """Add ``GET /health`` to `app`.

    Args:
        state: the app's `diffserve.entrypoints.openai.app.ServerState` (``model_name``,
            ``require_service()``).
    """

    @app.get("/health", responses={503: {"model": ErrorResponse}})
    async def health() -> JSONResponse:
        """200 when the model is loaded and requests are admitted; 503 otherwise."""
        state.require_service()
        return JSONResponse({"status": "ok", "model": state.model_name})
