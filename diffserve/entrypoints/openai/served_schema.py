"""The OpenAPI schema ``GET /openapi.json`` serves: FastAPI's schema of the app's routes, made to
state what the server enforces for the loaded model (`served_openapi`).

- The routes of a capability the model lacks (`CAPABILITY_PATHS`: edits need a model that takes
  input images, ``/v1/videos`` a video model, ``/v1/videos/streams`` a family that streams
  chunks, ``/v1/images/generations`` an image model) are left out: they answer 404
  (`middleware.CapabilityGate`).
- Each generation route's request body lists only the fields the model takes, with the model's
  and the engine's ranges (`protocol.request_json_schema`), as JSON and, where the route takes
  forms, as ``multipart/form-data``.
- Every operation lists the statuses the server answers it with: 400 for invalid parameters
  (FastAPI's default 422 is never sent: `errors.validation_error` answers 400), 401 where
  ``--api-key`` protects the path, 400 ``invalid_host`` with ``--allowed-hosts``.
- Event streams are ``text/event-stream`` responses whose schema describes one event (OpenAPI
  3.1), its JSON ``data`` by the payload schemas of `protocol.SSE_PAYLOAD_MODELS`, added to the
  components here.

Until the model is loaded the schema lists every route with the model-independent limits. It
is rebuilt on every request.
"""

from __future__ import annotations

from typing import Any

from pydantic.json_schema import models_json_schema

from diffserve.entrypoints.openai.protocol import (
    SSE_PAYLOAD_MODELS,
    ImageEditRequest,
    ImageGenerationRequest,
    VideoCreateRequest,
    request_json_schema,
    seconds_schema,
    served_cache_qualities,
)
from diffserve.entrypoints.openai.request_body import JSON, MULTIPART, form_schema
from diffserve.entrypoints.openai.services.edits import EDITS_PATH, edit_form_schema
from diffserve.entrypoints.openai.services.video_streams import STREAMS_PATH, VideoStreamRequest
from diffserve.entrypoints.openai.services.videos import VIDEOS_PATH, max_video_seconds

GENERATIONS_PATH = "/v1/images/generations"
#: Path prefixes of the generation APIs -> the capability that serves them.
CAPABILITY_PATHS = {GENERATIONS_PATH: "text-to-image", EDITS_PATH: "image-edit", VIDEOS_PATH: "text-to-video",
                    STREAMS_PATH: "video-stream"}


def capability_of(path: str) -> str | None:
    """The capability serving `path` (a route or a request path), or None when none gates it
    (the longest matching prefix of `CAPABILITY_PATHS` wins: streams are under /v1/videos)."""
    for prefix in sorted(CAPABILITY_PATHS, key=len, reverse=True):
        if path == prefix or path.startswith(prefix + "/"):
            return CAPABILITY_PATHS[prefix]
    return None


def served_openapi(schema: dict[str, Any], state: Any) -> dict[str, Any]:
    """`schema` (FastAPI's, for the app's routes) as served for `state`'s loaded model (see
    the module docstring); unchanged while the model loads.

    Args:
        schema: the app's OpenAPI schema (modified in place and returned).
        state: the `ServerState`: ``capabilities`` and ``images.engine`` (spec, config).
    """
    _, definitions = models_json_schema([(model, "serialization") for model in SSE_PAYLOAD_MODELS],
                                        ref_template="#/components/schemas/{model}")
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components.update(definitions.get("$defs", {}))
    _status_codes(schema, state)
    capabilities = state.capabilities
    if capabilities is None:
        return schema
    paths = schema["paths"]
    for path in list(paths):
        capability = capability_of(path)
        if capability is not None and capability not in capabilities:
            del paths[path]
    engine = state.images.engine
    spec, config = engine.spec, engine.config
    limits = config.limits
    max_n = min(limits.max_num_images_per_prompt, config.max_waiting_requests)

    def body(path: str, media_type: str, value: dict[str, Any]) -> None:
        operation = paths.get(path, {}).get("post")
        if operation is not None:
            operation["requestBody"]["content"][media_type]["schema"] = value

    levels = served_cache_qualities(config)
    body(GENERATIONS_PATH, JSON, request_json_schema(spec, limits, max_n, ImageGenerationRequest, levels))
    body(EDITS_PATH, MULTIPART, edit_form_schema(request_json_schema(spec, limits, max_n, ImageEditRequest, levels),
                                                 spec.max_input_images, spec.accepts_mask))
    if "text-to-video" in capabilities:
        video = video_request_schema(spec, limits, levels)
        body(VIDEOS_PATH, JSON, video)
        form = form_schema(video, {})
        form["properties"]["seconds"] = seconds_schema(max_video_seconds(spec, limits))[0]  # text: whole seconds
        body(VIDEOS_PATH, MULTIPART, form)
    body(STREAMS_PATH, JSON, request_json_schema(spec, limits, None, VideoStreamRequest, levels))
    return schema


_ERROR = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}


def _status_codes(schema: dict[str, Any], state: Any) -> None:
    """Make each operation's responses the statuses the server answers it with (see the module
    docstring)."""
    key_protects = getattr(state, "key_protects", None)
    for path, operations in schema["paths"].items():
        for operation in operations.values():
            responses = operation.setdefault("responses", {})
            if responses.pop("422", None) is not None and any(map(_can_fail, operation.get("parameters", []))):
                responses.setdefault("400", {**_ERROR, "description": "Invalid parameter"})
            if key_protects is not None and key_protects(path):
                responses["401"] = {**_ERROR, "description": "Missing or wrong API key (--api-key)"}
            if getattr(state, "checks_host", False):
                responses.setdefault("400", {**_ERROR, "description": "Bad request"})
                responses["400"]["description"] += "; or a Host header not in --allowed-hosts"
    schema["components"]["schemas"].pop("HTTPValidationError", None)
    schema["components"]["schemas"].pop("ValidationError", None)


def _can_fail(parameter: dict[str, Any]) -> bool:
    """Whether a value of `parameter` can fail validation (anything but a plain string)."""
    value = parameter.get("schema", {})
    return value.get("type") != "string" or bool(set(value) - {"type", "title", "description"})


def video_request_schema(spec: Any, limits: Any, cache_qualities: list[str] | None = None) -> dict[str, Any]:
    """The JSON schema of ``POST /v1/videos`` for a video model: `protocol.request_json_schema`
    with ``seconds`` in the model's range (`services.videos.max_video_seconds`) and given alone:
    not with a non-null ``num_frames`` or ``fps``."""
    schema = request_json_schema(spec, limits, None, VideoCreateRequest, cache_qualities)
    schema["properties"]["seconds"]["anyOf"] = seconds_schema(max_video_seconds(spec, limits)) + [{"type": "null"}]
    given = {"not": {"type": "null"}}
    schema["not"] = {"anyOf": [{"required": ["seconds", other], "properties": {"seconds": given, other: given}}
                               for other in ("num_frames", "fps")]}
    return schema
