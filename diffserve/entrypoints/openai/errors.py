"""HTTP errors in OpenAI's format: ``{"error": {"message", "type", "param", "code"}}``.

Status codes:
    400 invalid_request_error: any invalid, unknown or missing field, malformed JSON, wrong
        types (``param`` names the field when there is one; an engine error on ``height`` or
        ``width``, e.g. over the model's maximum, is ``param="size"``);
    404 invalid_request_error: unknown model, image file or route;
    413 invalid_request_error: request body over the size limit;
    429 rate_limit_error: the engine's waiting queue has no room for all ``n`` images (with
        ``Retry-After``);
    499 (log and metrics only): the client disconnected before the response (also while still
        sending the request body);
    500 server_error: a request failed inside the engine (never caused by input alone);
    503 service_unavailable: the model is still loading, or the server is shutting down.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from diffserve.core.errors import DeadlineUnmeetableError, EngineOverloadedError, InvalidRequestError, UnknownLoraError

logger = logging.getLogger(__name__)

#: Status logged and counted when the client went away before its response.
CLIENT_CLOSED_REQUEST = 499
#: Seconds a client is told to wait after a 429.
RETRY_AFTER_S = 1

# Engine field names -> the API parameter a client sent.
_ENGINE_FIELD_TO_PARAM = {
    "height": "size",
    "width": "size",
    "num_images_per_prompt": "n",
    "extra": "extra_params",
}


class APIError(Exception):
    """An error to send as an OpenAI-format response.

    Args:
        status_code: HTTP status.
        message: human-readable message (names the field and the allowed values).
        type: OpenAI error type (``invalid_request_error``, ``rate_limit_error``, ...).
        param: the offending request field, or None.
        code: short machine-readable code (``invalid_value``, ``model_not_found``, ...).
        headers: extra response headers (e.g. ``Retry-After``).
    """

    def __init__(self, status_code: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        """The JSON body ``{"error": {...}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def to_response(self) -> JSONResponse:
        """This error as a `JSONResponse`."""
        return JSONResponse(self.body(), status_code=self.status_code, headers=self.headers)


def invalid_request(exc: InvalidRequestError) -> APIError:
    """400 for an engine/validation `InvalidRequestError` (404 ``lora_not_found`` for an
    `UnknownLoraError`); ``param`` is the API field name (``height``/``width`` -> ``size``,
    ``num_images_per_prompt`` -> ``n``)."""
    param = _ENGINE_FIELD_TO_PARAM.get(exc.field, exc.field)
    if isinstance(exc, UnknownLoraError):
        return APIError(404, str(exc), param=param, code="lora_not_found")
    return APIError(400, str(exc), param=param, code="invalid_value")


def invalid_after_queueing(message: str, field: str) -> APIError:
    """400 ``invalid_value`` for a request the engine failed because its field `field` proved
    invalid only after it was queued (`GenerationOutput.error_param`: e.g. ``loras`` naming a
    ``--lora-dir`` file that failed to load); ``param`` as in `invalid_request`."""
    return APIError(400, message, param=_ENGINE_FIELD_TO_PARAM.get(field, field), code="invalid_value")


def overloaded(exc: EngineOverloadedError | str) -> APIError:
    """429 with ``Retry-After`` for a full waiting queue (code ``rate_limit_exceeded``), or a
    deadline the engine predicts it cannot meet (``--admission slo``: ``deadline_unmeetable``,
    ``param`` ``deadline_s``)."""
    unmeetable = isinstance(exc, DeadlineUnmeetableError)
    return APIError(429, str(exc), type="rate_limit_error", param="deadline_s" if unmeetable else None,
                    code="deadline_unmeetable" if unmeetable else "rate_limit_exceeded",
                    headers={"Retry-After": str(RETRY_AFTER_S)})


def unavailable(message: str, code: str) -> APIError:
    """503 (model loading, or shutting down) with ``Retry-After``."""
    return APIError(503, message, type="service_unavailable", code=code,
                    headers={"Retry-After": str(RETRY_AFTER_S)})


def validation_error(errors: list[dict[str, Any]]) -> APIError:
    """400 for pydantic/FastAPI validation errors; reports the first one.

    ``param`` is the top-level body field, or the query / path parameter (``None`` for
    malformed JSON or a non-object body).
    """
    if not errors:
        return APIError(400, "invalid request", code="invalid_value")
    err = errors[0]
    kind = str(err.get("type", ""))
    loc = list(err.get("loc", ()))
    if loc and loc[0] in ("body", "query", "path"):
        loc = loc[1:]
    field = loc[0] if loc and isinstance(loc[0], str) else None
    msg = str(err.get("msg", "invalid value"))
    if kind == "json_invalid":
        detail = (err.get("ctx") or {}).get("error", msg)
        return APIError(400, f"We could not parse the JSON body of your request: {detail}", code="invalid_json")
    if field is None:
        if kind == "missing":
            return APIError(400, "The request body is required: a JSON object.", code="invalid_json")
        return APIError(400, f"The request body must be a JSON object ({msg}).", code="invalid_json")
    if kind == "extra_forbidden":
        return APIError(400, f"Unrecognized request argument supplied: {field}", param=field,
                        code="unknown_parameter")
    if kind == "missing":
        return APIError(400, f"Missing required parameter: '{field}'.", param=field,
                        code="missing_required_parameter")
    code = "invalid_type" if kind.endswith("_type") else "invalid_value"
    return APIError(400, f"Invalid value for '{field}': {msg}", param=field, code=code)


def _allowed_methods(request: Request) -> list[str]:
    """The methods of all the app's routes whose path matches the request's (only those of a
    route spelled exactly as the request's path when there is one), less the operations the
    served OpenAPI schema leaves out (routes of capabilities the loaded model lacks)."""
    from starlette.routing import Match

    paths = request.app.openapi().get("paths", {})
    methods: set[str] = set()
    matching = [route for route in request.app.router.routes if route.matches(request.scope)[0] is not Match.NONE]
    literal = [route for route in matching if getattr(route, "path", None) == request.scope["path"]]
    for route in literal or matching:  # /v1/videos/streams is that resource, not /v1/videos/{video_id}
        for method in getattr(route, "methods", None) or ():
            served = paths.get(route.path, {})
            if not getattr(route, "include_in_schema", False) or method.lower() in served \
                    or (method == "HEAD" and "get" in served):
                methods.add(method)
    return sorted(methods)


def install_error_handlers(app: FastAPI) -> None:
    """Make every error the app returns use OpenAI's format (see the module docstring)."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.to_response()

    @app.exception_handler(RequestValidationError)
    async def _request_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(list(exc.errors())).to_response()

    @app.exception_handler(InvalidRequestError)
    async def _invalid(request: Request, exc: InvalidRequestError) -> JSONResponse:
        return invalid_request(exc).to_response()

    @app.exception_handler(EngineOverloadedError)
    async def _overloaded(request: Request, exc: EngineOverloadedError) -> JSONResponse:
        return overloaded(exc).to_response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        headers = getattr(exc, "headers", None)
        if exc.status_code == 405:  # every method of the path (Starlette names only its first route's)
            headers = {**(headers or {}), "Allow": ", ".join(_allowed_methods(request))}
        return APIError(exc.status_code, str(exc.detail), type=kind, code=code, headers=headers).to_response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return APIError(500, "internal server error (see the server log)", type="server_error",
                        code="internal_error").to_response()
