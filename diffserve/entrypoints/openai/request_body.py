"""Reading request bodies: JSON (``POST /v1/images/generations``, ``POST /v1/videos``) and
``multipart/form-data`` (``POST /v1/images/edits``, ``POST /v1/videos`` as the ``openai`` client
sends it), with size limits, validation into the request models and errors in OpenAI's format.

Rules:
    - The body is read in chunks and refused with 413 as soon as it exceeds its limit (1 MiB
      for JSON, `MAX_FORM_BYTES` for forms); the connection layer bounds how long it may take
      (``--body-timeout``, 408).
    - A route takes only the content types it lists (415 otherwise).
    - Forms follow the ``openai`` client's conventions: a list is sent as repeated ``name[]``
      parts (read back under ``name``), a None value is simply absent, booleans are ``true`` /
      ``false``. Text values are validated with type coercion (``"2"`` is the integer 2); the
      same field given twice, or a file where text is expected, is a 400 naming the field. A
      file field whose part has no ``filename`` (some form encoders omit it) is read as the
      part's bytes.
    - Cross-site form posts: browsers send forms cross-origin without a CORS preflight, so a
      form route refuses a request whose ``Origin`` header names another site (403), unless
      that origin is in ``--allowed-origins``. JSON routes need no such check: their
      ``Content-Type: application/json`` always triggers a preflight.
"""

from __future__ import annotations

import copy
import json
import logging
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import urlsplit

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException

from diffserve.entrypoints.openai.errors import CLIENT_CLOSED_REQUEST, APIError
from diffserve.entrypoints.openai.http_protocol import BODY_TIMEOUT_KEY

logger = logging.getLogger(__name__)

#: Largest accepted JSON body, bytes.
MAX_BODY_BYTES = 1 << 20
#: Largest accepted multipart body (all files and fields together), bytes.
MAX_FORM_BYTES = 64 << 20
#: Most file parts and text parts of a form.
MAX_FORM_FILES = 32
MAX_FORM_FIELDS = 128
#: ASGI scope key the status-counting middleware reads: True when the client went away first.
CLIENT_DISCONNECTED_KEY = "diffserve.client_disconnected"

JSON = "application/json"
MULTIPART = "multipart/form-data"

Model = TypeVar("Model", bound=BaseModel)


def media_type(request: Request) -> str:
    """The request's media type (``Content-Type`` without parameters, lower case; "" if none)."""
    return request.headers.get("content-type", "").split(";")[0].strip().lower()


def require_media_type(request: Request, allowed: tuple[str, ...]) -> str:
    """The request's media type, when it is one of `allowed`.

    Raises:
        APIError: 415 naming what the route takes.
    """
    kind = media_type(request)
    if kind not in allowed:
        shown = f"'{kind}'" if kind else "none"
        what = " or ".join(f"'Content-Type: {a}'" for a in allowed)
        raise APIError(415, f"Unsupported Content-Type {shown}: send the request body with {what}.",
                       code="unsupported_media_type")
    return kind


async def read_limited(request: Request, max_bytes: int) -> bytes:
    """The whole body, read in chunks.

    Raises:
        APIError: 413 once it exceeds `max_bytes` (or its declared Content-Length does).
        starlette.requests.ClientDisconnect: the client went away mid-body.
    """
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise APIError(413, f"request body over {max_bytes} bytes", code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise APIError(413, f"request body over {max_bytes} bytes", code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def validate(model: type[Model], data: object, strict: bool = True) -> Model:
    """`model` validated from `data` (``strict=False`` coerces text, for forms).

    Raises:
        RequestValidationError: schema violations (mapped to 400 with ``param``).
    """
    try:
        return model.model_validate(data, strict=strict)
    except ValidationError as exc:
        errors = [{**err, "loc": ("body", *err["loc"])} for err in exc.errors(include_url=False)]
        raise RequestValidationError(errors) from None


async def read_json(request: Request, model: type[Model], check_type: bool = True) -> Model:
    """Read, size-check, parse and validate a JSON body.

    Args:
        check_type: refuse any Content-Type but ``application/json`` (415).

    Raises:
        APIError: 415 unless JSON; 413 over `MAX_BODY_BYTES`; 400 malformed JSON (including
            nesting too deep).
        RequestValidationError: schema violations (mapped to 400 with ``param``).
    """
    if check_type:
        require_media_type(request, (JSON,))
    raw = await read_limited(request, MAX_BODY_BYTES)
    if not raw.strip():
        raise APIError(400, "The request body is required: a JSON object.", code="invalid_json")
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise APIError(400, f"We could not parse the JSON body of your request: {exc}", code="invalid_json") from None
    return validate(model, data)


@dataclass
class UploadedFile:
    """One file part of a form.

    Attributes:
        field: the field name (``[]`` removed).
        filename: the client's file name (may be None).
        content_type: the part's declared media type (may be None; not trusted).
        data: the file's bytes.
    """

    field: str
    filename: str | None
    content_type: str | None
    data: bytes


@dataclass
class FormBody:
    """A parsed ``multipart/form-data`` body: text fields (each given once) and files by field."""

    fields: dict[str, str] = field(default_factory=dict)
    files: dict[str, list[UploadedFile]] = field(default_factory=dict)

    def validate(self, model: type[Model]) -> Model:
        """The text fields validated into `model` with type coercion.

        Raises:
            RequestValidationError: as `validate`.
        """
        return validate(model, self.fields, strict=False)


async def read_form(request: Request, file_fields: frozenset[str] | set[str],
                    max_bytes: int = MAX_FORM_BYTES) -> FormBody:
    """Read and parse a ``multipart/form-data`` body (the caller checked the content type).

    Args:
        file_fields: the fields that take files (``image`` also matches ``image[]``); every
            other field must be text.
        max_bytes: body size limit.

    Raises:
        APIError: 413 over `max_bytes`; 400 malformed multipart, too many parts, a text field
            given twice or a file for a text field (``param`` names the field).
        starlette.requests.ClientDisconnect: the client went away mid-body.
    """
    request._body = await read_limited(request, max_bytes)  # Request.form() parses the cached body
    try:
        form = await request.form(max_files=MAX_FORM_FILES, max_fields=MAX_FORM_FIELDS, max_part_size=max_bytes)
    except MultiPartException as exc:
        raise APIError(400, f"We could not parse the multipart/form-data body of your request: {exc.message}",
                       code="invalid_multipart") from None
    body = FormBody()
    try:
        for raw_name, value in form.multi_items():
            name = raw_name[:-2] if raw_name.endswith("[]") else raw_name
            if isinstance(value, UploadFile):
                if name not in file_fields:
                    raise APIError(400, f"Invalid value for '{name}': expected text, got a file.", param=name,
                                   code="invalid_type")
                body.files.setdefault(name, []).append(
                    UploadedFile(name, value.filename, value.content_type, await value.read()))
                continue
            if name in file_fields:  # a file part without a filename
                body.files.setdefault(name, []).append(UploadedFile(name, None, None, _part_bytes(value)))
                continue
            if name in body.fields:
                raise APIError(400, f"Invalid value for '{name}': given more than once.", param=name,
                               code="invalid_value")
            body.fields[name] = value
    finally:
        await form.close()
    return body


def _part_bytes(text: str) -> bytes:
    """The bytes of a part Starlette decoded as text: UTF-8, or Latin-1 when the bytes are not
    valid UTF-8 (always the case for PNG, JPEG and WebP files)."""
    try:
        raw = text.encode("latin-1")
        raw.decode("utf-8")
    except UnicodeEncodeError:  # a character over U+00FF: it was UTF-8
        return text.encode("utf-8")
    except UnicodeDecodeError:  # not UTF-8: Starlette fell back to Latin-1, which is reversible
        return raw
    return text.encode("utf-8")


def form_schema(schema: dict[str, Any], files: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The OpenAPI schema of a ``multipart/form-data`` body from a request model's JSON schema:
    forms cannot send null, so the null branches and the null-only fields are left out; `files`
    (field -> schema) are added.
    """
    schema = copy.deepcopy(schema)
    properties = {}
    for name, prop in schema["properties"].items():
        if prop.get("type") == "null":
            continue
        branches = [b for b in prop.get("anyOf", []) if b.get("type") != "null"]
        if "anyOf" in prop and len(branches) == 1:
            prop = {**{k: v for k, v in prop.items() if k not in ("anyOf", "default")}, **branches[0]}
        elif "anyOf" in prop:
            prop = {**prop, "anyOf": branches}
            prop.pop("default", None)
        properties[name] = prop
    schema["properties"] = {**properties, **files}
    return schema


def check_form_origin(request: Request, allowed_origins: list[str] | None, public_url: str | None) -> None:
    """Refuse a cross-site form post (see the module docstring).

    A request without ``Origin`` (not from a browser page), or whose origin is the server's own
    (the ``Host`` it was sent to, or `public_url`), or listed in `allowed_origins` (``*``: any)
    passes.

    Raises:
        APIError: 403 ``cross_origin_forbidden``.
    """
    origin = request.headers.get("origin")
    if origin is None:
        return
    allowed = allowed_origins or []
    if "*" in allowed or origin.rstrip("/") in allowed:
        return
    parts = urlsplit(origin)
    if parts.netloc and parts.netloc == request.headers.get("host"):
        return
    if public_url and (parts.scheme, parts.netloc) == urlsplit(public_url)[:2]:
        return
    raise APIError(403, f"Cross-origin form posts from {origin!r} are refused; allow the site with "
                        "--allowed-origins.", code="cross_origin_forbidden")


def log_body_disconnect(request: Request) -> None:
    """Log (one line) and mark for the metrics a client that disconnected mid-body (or whose
    body timed out: the connection layer answered 408 and closed it)."""
    request.scope[CLIENT_DISCONNECTED_KEY] = True
    client = request.client
    if request.scope.get(BODY_TIMEOUT_KEY):
        status, what = 408, "request body timed out"
    else:
        status, what = CLIENT_CLOSED_REQUEST, "client disconnected while sending the request body"
    logger.info('%s:%s - "%s %s" %d %s', client.host if client else "-", client.port if client else "-",
                request.method, request.url.path, status, what)
