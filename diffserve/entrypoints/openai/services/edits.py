"""``POST /v1/images/edits`` (OpenAI's image edits): the ``multipart/form-data`` request parser.

The request is served by the same `ImageGenerationService` as generations; this module only
turns the form into an `ImageEditRequest` and the input images:

- files ``image`` (one) or ``image[]`` (several, as the ``openai`` client sends a list), and an
  optional ``mask``: PNG, JPEG or WebP, each at most `diffserve.core.inputs.MAX_IMAGE_FILE_BYTES`
  bytes and `diffserve.core.inputs.MAX_INPUT_PIXELS` pixels (400 naming the field otherwise,
  as for an unreadable file). EXIF orientation is applied.
- the mask follows OpenAI's convention when it has transparency (fully transparent pixels are
  edited), else diffusers' (white pixels are repainted); it must have the first image's size
  (400 ``mask`` otherwise). Models that do not inpaint refuse a mask (400 ``mask``).
- text fields: OpenAI's (``prompt``, ``model``, ``n``, ``size``, ``response_format``,
  ``output_format``, ``output_compression``, ``stream``, ``partial_images``, ...) and diffserve's
  extensions (``seed``, ``num_inference_steps``, ``guidance_scale``, ``true_cfg_scale``,
  ``negative_prompt``, ``stream_progress``, ``strength``); see `ImageEditRequest`.
- ``size="auto"`` (the default) is the first image's size rounded to the model's resolution
  multiple (`diffserve.core.inputs.auto_size`); the response's ``size`` says what was used.
- a model that takes no input images answers 400 (``param="image"``); ``markup`` is refused.

Streaming sends ``image_edit.partial_image`` / ``image_edit.completed`` events.
"""

from __future__ import annotations

import asyncio
import hashlib

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.requests import ClientDisconnect

from diffserve.entrypoints.openai.errors import CLIENT_CLOSED_REQUEST, APIError, invalid_request
from diffserve.entrypoints.openai.protocol import ErrorResponse, ImageEditRequest, ImagesResponse, image_sse_event_schema
from diffserve.entrypoints.openai.request_body import (
    MULTIPART,
    FormBody,
    check_form_origin,
    form_schema,
    log_body_disconnect,
    read_form,
    require_media_type,
)
from diffserve.core.errors import InvalidRequestError
from diffserve.core.inputs import MAX_INPUT_IMAGES, make_inputs, mask_from_image, read_image

EDITS_PATH = "/v1/images/edits"
#: Form fields that carry files.
FILE_FIELDS = frozenset({"image", "mask", "markup"})


def parse_edit_form(form: FormBody):
    """The edit request and its inputs from a parsed form.

    Returns:
        (`ImageEditRequest`, `RequestInputs`, SHA-256 digests of the uploaded files in form
        order: part of the request's identity, see
        `diffserve.entrypoints.openai.services.admission`).

    Raises:
        APIError: 400 naming the field: no image, ``markup`` given, an unreadable or too large
            image or mask, a mask of another size than the first image.
        RequestValidationError: an invalid text field (400 naming it).
    """
    body = form.validate(ImageEditRequest)
    if "markup" in form.files:
        raise APIError(400, "Invalid value for 'markup': not supported (use mask).", param="markup",
                       code="invalid_value")
    uploads = form.files.get("image", [])
    if not uploads:
        raise APIError(400, "Missing required parameter: 'image'.", param="image", code="missing_required_parameter")
    masks = form.files.get("mask", [])
    if len(masks) > 1:
        raise APIError(400, "Invalid value for 'mask': give one mask (it applies to the first image).",
                       param="mask", code="invalid_value")
    try:
        images = [read_image(upload.data, "image") for upload in uploads]
        mask = mask_from_image(read_image(masks[0].data, "mask")) if masks else None
        inputs = make_inputs(images, mask)
    except InvalidRequestError as exc:
        raise invalid_request(exc) from None
    digests = [hashlib.sha256(upload.data).digest() for upload in [*uploads, *masks]]
    return body, inputs, digests


def edit_form_schema(fields: dict | None = None, max_images: int = MAX_INPUT_IMAGES, mask: bool = True) -> dict:
    """OpenAPI schema of the ``multipart/form-data`` body: the text fields (`fields`, the JSON
    schema of `ImageEditRequest`, e.g. as served for the loaded model; default: all of them)
    and the files: ``image`` (at most `max_images`, several as ``image[]``) and, with `mask`,
    ``mask``."""
    binary = {"type": "string", "format": "binary"}
    files = {"image": {"anyOf": [binary, {"type": "array", "items": binary, "minItems": 1, "maxItems": max_images}],
                       "description": f"input image(s): PNG, JPEG or WebP files, at most {max_images} (several, or "
                                      "one, as image[])"}}
    if mask:
        files["mask"] = {**binary, "description": "mask: a PNG, JPEG or WebP file of the first image's size "
                                                  "(transparent pixels are edited)"}
    schema = form_schema(fields or ImageEditRequest.model_json_schema(), files)
    schema["required"] = sorted({*schema.get("required", []), "image"})
    return schema



def install_edit_routes(app: FastAPI, state, allowed_origins: list[str] | None = None,
                        public_url: str | None = None) -> None:
    """Add ``POST /v1/images/edits`` to an app built by
    `diffserve.entrypoints.openai.app.create_app`.

    Args:
        app: the FastAPI app (its OpenAI error handlers installed).
        state: the server state (``require_service()`` gives the `ImageGenerationService`).
        allowed_origins / public_url: the server's, for the cross-site form check
            (`request_body.check_form_origin`).
    """
    errors = {code: {"model": ErrorResponse} for code in (400, 403, 404, 408, 413, 415, 429, 500, 503)}

    @app.post(
        EDITS_PATH,
        response_model=ImagesResponse,
        responses={**errors, 200: {"description": "An ImagesResponse, or a text/event-stream when stream=true",
                                   "content": {"text/event-stream": {"schema": image_sse_event_schema("image_edit")}}}},
        openapi_extra={"requestBody": {"required": True, "content": {MULTIPART: {"schema": edit_form_schema()}}}},
    )
    async def create_edit(raw_request: Request) -> Response:
        """Edit images (OpenAI Images API, plus diffserve's extension fields)."""
        service = state.require_service()
        require_media_type(raw_request, (MULTIPART,))
        check_form_origin(raw_request, allowed_origins, public_url)
        try:
            form = await read_form(raw_request, FILE_FIELDS)
        except ClientDisconnect:
            log_body_disconnect(raw_request)
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        body, inputs, digests = await asyncio.to_thread(parse_edit_form, form)  # decoding: off the event loop
        return await service.create(body, raw_request, inputs=inputs, upload_digests=digests)
