"""OpenAI endpoints this server does not serve (chat, completions, embeddings, audio, image
variations, ...) answer a 404 in OpenAI's format that says so and names what is served, instead
of a bare "Not Found", so a client pointed at the wrong server learns why at once."""

from __future__ import annotations

from fastapi import FastAPI

from diffserve.entrypoints.openai.errors import APIError

#: Path -> what it is, for the message.
UNSUPPORTED_ENDPOINTS = {
    "/v1/images/variations": "image variations",
    "/v1/chat/completions": "chat completions",
    "/v1/completions": "text completions",
    "/v1/responses": "the Responses API",
    "/v1/embeddings": "embeddings",
    "/v1/moderations": "moderations",
    "/v1/audio/{rest:path}": "audio speech, transcriptions or translations",
}
#: What the server serves, for the message.
SERVED = ("POST /v1/images/generations, POST /v1/images/edits and the Videos API (/v1/videos); GET /v1/models "
          "says which the model supports")
_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE"]


def install_unsupported_routes(app: FastAPI) -> None:
    """Add the 404 routes of `UNSUPPORTED_ENDPOINTS` to `app` (left out of the OpenAPI schema)."""
    for path, what in UNSUPPORTED_ENDPOINTS.items():
        def unsupported(what: str = what, path: str = path) -> None:
            shown = path.replace("/{rest:path}", "/*")
            raise APIError(404, f"This server does not serve {what} ({shown}): diffserve serves diffusion models, "
                                f"through {SERVED}.", code="unsupported_endpoint")

        app.add_api_route(path, _without_parameters(unsupported), methods=_METHODS, include_in_schema=False)


def _without_parameters(raise_error):
    """An endpoint taking no request parameters that calls `raise_error` (FastAPI would read
    the defaults of `raise_error`'s arguments as query parameters)."""
    async def endpoint() -> None:
        raise_error()

    return endpoint
