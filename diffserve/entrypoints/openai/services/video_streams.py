"""Streaming video over HTTP: chunks as they are generated, and prompt changes mid-stream.

    POST /v1/videos/streams                            start a stream (a ``VideoStreamRequest``);
                                                       answers a ``text/event-stream``
    POST /v1/videos/streams/{stream_id}/interactions   change the prompt of its following chunks
                                                       (an ``InteractionRequest``)

Transport: Server-Sent Events, as OpenAI's streaming APIs (Images, Responses) use: plain HTTP
(auth headers, proxies, CORS as for every other route), read by OpenAI-style clients and by
browsers (``fetch`` with a readable body, since the stream is started by a POST with a JSON
body; ``EventSource`` only does GET). The stream is one-way, so interactions are separate
POSTs naming the stream's id; a WebSocket would carry both directions on one connection but
needs its own auth and proxy handling and is not what those clients consume.

Events of a stream (one-line JSON ``data:``; ``: keep-alive`` comments every heartbeat on a
quiet stream):

- ``video.stream.created`` ``{id, model, size, num_frames, num_chunks, fps, seed,
  output_format}``: first, carrying the id interactions name (also in ``X-Request-Id``);
- ``video.stream.progress`` ``{id, chunk_index, step, num_inference_steps}`` after every
  denoising step;
- ``video.stream.chunk`` ``{id, chunk_index, first_frame, num_frames, media_type, b64_data,
  event_ids}``: each chunk as soon as it is decoded, its new frames encoded on their own as a
  complete little file (``output_format`` mp4 (H.264, default), webp or gif, via
  `diffserve.media.video_encoding`) that plays alone; ``first_frame`` is its place in the
  whole video; ``event_ids`` are the interactions this chunk is the first to use;
- ``video.stream.completed`` ``{id, num_frames, seed, media_type, b64_data, prompt_truncated,
  negative_prompt_truncated, timings}``: the whole video in one file (``b64_data`` null with
  ``"include_video": false``), whether the first prompt / the negative prompt were cut at the
  text encoder's token limit, ``timings`` with ``chunk_s`` (seconds from arrival to each
  chunk: time to first chunk, inter-chunk gaps);
- ``error`` ``{type: "error", error: {message, type, param, code}}`` if the stream fails.

A client that disconnects aborts its stream (at the engine's next step). Interactions answer
200 ``{object: "video.stream.interaction", stream_id, event_id}``; 404 for an unknown stream,
409 for one that ended or has no chunk left to change, 400 for a request that is not a stream
or a model that cannot stream chunks, and for invalid fields.

`install_video_stream_routes` adds the routes to an app built by
`diffserve.entrypoints.openai.app.create_app`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from starlette.requests import ClientDisconnect

from diffserve.entrypoints.openai.errors import (CLIENT_CLOSED_REQUEST, APIError, invalid_after_queueing,
                                               invalid_request, overloaded, unavailable)
from diffserve.media.image_encoding import to_base64
from diffserve.entrypoints.openai.protocol import (
    CACHE_QUALITY_DESCRIPTION,
    DEADLINE_DESCRIPTION,
    PRIORITY_BOUND,
    PRIORITY_DESCRIPTION,
    scheduling_fields,
    LORAS_DESCRIPTION,
    CacheQuality,
    SamplerName,
    MAX_PROMPT_CHARS,
    PROMPT_PATTERN,
    SEED_BOUND,
    SIZE_PATTERN,
    TEXT_PATTERN,
    ErrorResponse,
    LoraScales,
    parse_size,
    sse_event_schema,
)
from diffserve.entrypoints.openai.services.images import (  # the Images API's SSE plumbing, shared
    HEARTBEAT,
    _DisconnectWatcher,
    _EventStreamResponse,
    _sse,
)
from diffserve.entrypoints.openai.services.admission import request_fingerprint
from diffserve.media.video_encoding import VIDEO_FORMATS, encode_video
from diffserve.core.errors import EngineDeadError, EngineOverloadedError, InteractionRefusedError, InvalidRequestError
from diffserve.core.outputs import EventType, RequestStatus, StreamEvent
from diffserve.engine.client import MAX_EVENT_ID_CHARS, MAX_TRANSITION_CHUNKS
from diffserve.core.sampling_params import MAX_GUIDANCE_SCALE, MAX_SEED, SamplingParams, as_float

logger = logging.getLogger(__name__)

STREAMS_PATH = "/v1/videos/streams"
#: Largest accepted request body, bytes (as for the Images API).
MAX_BODY_BYTES = 1 << 20
#: Seconds between checks that the engine loop is alive while a stream waits on it.
ENGINE_CHECK_INTERVAL_S = 0.5
#: HTTP status and error code of each `InteractionRefusedError.reason`.
REFUSAL_STATUS = {
    "unknown_request": (404, "stream_not_found"),
    "finished": (409, "stream_ended"),
    "last_chunk": (409, "no_chunk_left"),
    "not_streaming": (400, "not_a_stream"),
    "unsupported": (400, "streaming_unsupported"),
}


class VideoStreamRequest(BaseModel):
    """Body of ``POST /v1/videos/streams`` (unknown fields and coerced types are refused).

    Unset fields take the model's defaults (``size``, ``num_frames`` per chunk, steps,
    guidance, ``fps``); ``seed`` defaults to a random one (reported in the created event).
    """

    model_config = ConfigDict(extra="forbid", strict=True)

    prompt: str = Field(max_length=MAX_PROMPT_CHARS, json_schema_extra={"minLength": 1, "pattern": PROMPT_PATTERN},
                        description="the first chunks' prompt (interactions change it later)")
    num_chunks: int = Field(ge=1, description="chunks to generate, 1..the engine's limit (1024 by default)")
    model: str | None = Field(None, description="the served model's name (GET /v1/models); optional")
    size: str | None = Field(None, description='"WIDTHxHEIGHT" in pixels, or "auto" (the model default)',
                             json_schema_extra={"pattern": SIZE_PATTERN})
    num_frames: int | None = Field(None, ge=1, description="frames per chunk (4k + 1 for Wan); the first chunk "
                                   "sends them all, each later one all but the one it repeats")
    fps: int | None = Field(None, ge=1, le=240, description="playback rate of the encoded chunks")
    negative_prompt: str | None = Field(None, max_length=MAX_PROMPT_CHARS, json_schema_extra={"pattern": TEXT_PATTERN})
    num_inference_steps: int | None = Field(None, ge=1, description="denoising steps per chunk")
    guidance_scale: float | None = Field(None, ge=0, le=MAX_GUIDANCE_SCALE, allow_inf_nan=False)
    seed: int | None = Field(None, ge=0, lt=SEED_BOUND)
    output_format: Literal["mp4", "webp", "gif"] = Field("mp4", description="encoding of each chunk and of the "
                                                         "whole video")
    include_video: bool = Field(True, description="send the whole video again in the completed event")
    loras: LoraScales | None = Field(None, description=LORAS_DESCRIPTION)
    cache_quality: CacheQuality | None = Field(None, description=CACHE_QUALITY_DESCRIPTION)
    scheduler: SamplerName | None = Field(
        None, description="sampler (README 'Samplers'); null = the model folder's own scheduler")
    priority: int | None = Field(None, ge=-PRIORITY_BOUND, lt=PRIORITY_BOUND, description=PRIORITY_DESCRIPTION)
    deadline_s: float | None = Field(None, gt=0, allow_inf_nan=False, description=DEADLINE_DESCRIPTION)

    @field_validator("num_chunks", "num_frames", "fps", "num_inference_steps", "seed", "priority", mode="before")
    @classmethod
    def _integral_numbers_are_integers(cls, value: Any) -> Any:
        if isinstance(value, float) and value.is_integer():
            return int(value)  # JSON Schema's "integer" is any number without a fraction
        return value

    @field_validator("deadline_s", mode="before")
    @classmethod
    def _integer_deadline_is_a_number(cls, value: Any) -> Any:
        return as_float(value) if isinstance(value, int) and not isinstance(value, bool) else value


#: An interaction's ``event_id`` over HTTP: printable ASCII (the engine takes any printable text;
#: JSON Schema's regular expressions cannot state Python's `str.isprintable`).
EVENT_ID_PATTERN = r"^[\x20-\x7e]+$"


class InteractionRequest(BaseModel):
    """Body of ``POST /v1/videos/streams/{stream_id}/interactions`` (see
    `diffserve.engine.client.EngineClient.submit_interaction`)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    prompt: str = Field(max_length=MAX_PROMPT_CHARS, json_schema_extra={"minLength": 1, "pattern": PROMPT_PATTERN})
    transition_chunks: int = Field(0, ge=0, le=MAX_TRANSITION_CHUNKS,
                                   description="chunks over which the prompt moves to the new one")
    event_id: str | None = Field(None, min_length=1, max_length=MAX_EVENT_ID_CHARS, pattern=EVENT_ID_PATTERN,
                                 description="echoed on the first chunk that uses the new prompt (printable "
                                             "ASCII; default: a fresh id, returned)")

    @field_validator("transition_chunks", mode="before")
    @classmethod
    def _integral_numbers_are_integers(cls, value: Any) -> Any:
        if isinstance(value, float) and value.is_integer():
            return int(value)
        return value


class InteractionResponse(BaseModel):
    """Response of ``POST /v1/videos/streams/{stream_id}/interactions``: the id the chunks that
    use the new prompt carry in their ``event_ids``."""

    object: Literal["video.stream.interaction"] = "video.stream.interaction"
    stream_id: str
    event_id: str


#: The events of a stream, in order (besides ``error``).
STREAM_EVENTS = ("video.stream.created", "video.stream.progress", "video.stream.chunk", "video.stream.completed")


async def _read_body(request: Request, model: type[BaseModel]) -> BaseModel:
    """The JSON body of `request` validated as `model`.

    Raises:
        APIError: 415 unless ``Content-Type: application/json``, 413 over `MAX_BODY_BYTES`,
            400 malformed JSON.
        RequestValidationError: schema violations (a 400 naming the field).
        ClientDisconnect: the client went away while sending it.
    """
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type != "application/json":
        raise APIError(415, "Unsupported Content-Type: send the request body as JSON with "
                            "'Content-Type: application/json'.", code="unsupported_media_type")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise APIError(413, f"request body over {MAX_BODY_BYTES} bytes", code="request_too_large")
        chunks.append(chunk)
    try:
        data = json.loads(b"".join(chunks))
    except (ValueError, RecursionError) as exc:
        raise APIError(400, f"We could not parse the JSON body of your request: {exc}", code="invalid_json") from None
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False)]) \
            from None


class VideoStreamService:
    """Serves video streams on the server state's engine (see the module docstring).

    Args:
        state: the server state: ``engine`` (the `EngineClient`), ``model_name``,
            ``heartbeat_s``, ``metrics`` (`ServerMetrics`: streams count as requests, engine
            outcomes and videos), ``require_service()``.
    """

    def __init__(self, state: Any):
        self.state = state

    # ----------------------------------------------------------------------------- start
    async def start(self, raw_request: Request) -> Response:
        """Validate, queue the stream and answer its event stream.

        Raises:
            APIError: 400 invalid field, 404 unknown model,
                429 queue full, 503 not ready / shutting down / engine dead.
        """
        self.state.require_service()
        try:
            body: VideoStreamRequest = await _read_body(raw_request, VideoStreamRequest)  # type: ignore[assignment]
        except ClientDisconnect:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        engine = self.state.engine
        if body.model is not None and body.model != self.state.model_name:
            raise APIError(404, f"The model '{body.model}' does not exist; this server serves "
                                f"'{self.state.model_name}'.", param="model", code="model_not_found")
        if not engine.model_info.chunk_streaming:
            raise APIError(400, f"the served model ({engine.model_info.pipeline}) cannot stream video chunks",
                           param="num_chunks", code="streaming_unsupported")
        try:
            size = parse_size(body.size)
            width, height = size if size is not None else (None, None)
            params = SamplingParams(negative_prompt=body.negative_prompt, height=height, width=width,
                                    num_frames=body.num_frames, fps=body.fps, num_chunks=body.num_chunks,
                                    num_inference_steps=body.num_inference_steps,
                                    guidance_scale=body.guidance_scale, seed=body.seed, output_type="np",
                                    loras=body.loras, cache_quality=body.cache_quality, scheduler=body.scheduler,
                                    **scheduling_fields(body))
            [request] = engine.input_processor.process(body.prompt, params)  # seed, checks, plan
            engine.check_loras(request.params.loras)  # known adapter names (a load starts for one not held)
        except InvalidRequestError as exc:
            raise invalid_request(exc) from None
        resolved = request.params
        stream_id = f"vstream-{uuid.uuid4().hex}"
        client = raw_request.client
        fingerprint = request_fingerprint(client.host if client else None, STREAMS_PATH, body.model_dump_json())
        try:
            self.state.require_service().check_queue_room(1, fingerprint)  # the line of refused requests too
            events = engine.generate(request, request_id=stream_id)
            queued = await anext(events)  # add_request's errors surface here, before any byte is sent
        except InvalidRequestError as exc:
            raise invalid_request(exc) from None
        except EngineOverloadedError as exc:
            if self.state.draining:
                raise unavailable("the server is shutting down and accepts no new requests", "shutting_down") \
                    from None
            raise overloaded(exc) from None
        except EngineDeadError:
            raise unavailable("the engine loop stopped; the server cannot generate (see the server log)",
                              "engine_dead") from None
        created = {"type": "video.stream.created", "id": stream_id, "created_at": int(time.time()),
                   "model": self.state.model_name, "size": f"{resolved.width}x{resolved.height}",
                   "num_frames": resolved.num_frames, "num_chunks": resolved.num_chunks, "fps": resolved.fps,
                   "seed": resolved.seed, "output_format": body.output_format}
        watcher = _DisconnectWatcher(raw_request.receive, lambda: engine.abort(stream_id))
        watcher.start()
        logger.info("%s: stream of %d chunk(s) x %d frames %s", stream_id, resolved.num_chunks, resolved.num_frames,
                    created["size"])
        return _EventStreamResponse(
            self._stream(stream_id, created, queued, events, body, resolved.fps, watcher),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "X-Request-Id": stream_id})

    async def _stream(self, stream_id: str, created: dict, queued: StreamEvent, events: AsyncIterator[StreamEvent],
                      body: VideoStreamRequest, fps: int, watcher: _DisconnectWatcher) -> AsyncIterator[str]:
        engine = self.state.engine
        media_type = VIDEO_FORMATS[body.output_format][1]
        queue: asyncio.Queue[StreamEvent] = asyncio.Queue()
        queue.put_nowait(queued)

        async def pump() -> None:
            try:
                async for event in events:
                    queue.put_nowait(event)
            except Exception as exc:  # noqa: BLE001 - surfaced as the stream's failure
                logger.exception("engine stream of %s raised", stream_id)
                queue.put_nowait(StreamEvent(stream_id, EventType.FAILED, error=f"{type(exc).__name__}: {exc}"))

        task = asyncio.create_task(pump())
        loop = asyncio.get_running_loop()
        last_sent = loop.time()
        frames_sent = 0
        metrics = self.state.metrics
        ended = False  # the engine's final event was read (and counted)
        try:
            yield _sse(created["type"], created)
            while True:
                try:
                    event = await asyncio.wait_for(queue.get(), ENGINE_CHECK_INTERVAL_S)
                except asyncio.TimeoutError:
                    if not engine.is_running:
                        yield _error_event(unavailable("the engine loop stopped (see the server log)", "engine_dead"))
                        return
                    if loop.time() - last_sent >= self.state.heartbeat_s / 2:
                        last_sent = loop.time()
                        yield HEARTBEAT
                    continue
                last_sent = loop.time()
                if event.type is EventType.PROGRESS:
                    yield _sse("video.stream.progress", {"type": "video.stream.progress", "id": stream_id,
                                                         "chunk_index": event.chunk_index, "step": event.step,
                                                         "num_inference_steps": event.total})
                elif event.type is EventType.CHUNK:
                    try:
                        data = await asyncio.to_thread(encode_video, event.output, fps, body.output_format)
                    except Exception as exc:  # noqa: BLE001 - an error event, never a cut connection
                        logger.exception("%s: encoding chunk %d failed", stream_id, event.chunk_index)
                        yield _error_event(APIError(500, f"video stream failed: encoding chunk {event.chunk_index}: "
                                                         f"{exc}", type="server_error", code="generation_failed"))
                        return
                    chunk = {"type": "video.stream.chunk", "id": stream_id, "chunk_index": event.chunk_index,
                             "first_frame": frames_sent, "num_frames": len(event.output), "media_type": media_type,
                             "b64_data": to_base64(data), "event_ids": event.event_ids, "created_at": int(time.time())}
                    frames_sent += len(event.output)
                    yield _sse(chunk["type"], chunk)
                elif event.type.is_final:
                    output = event.output
                    ended = True
                    if output is not None:
                        metrics.observe_output(output)
                    else:
                        metrics.observe_abandoned(1, outcome="failed")
                    if output is not None and output.status is RequestStatus.FINISHED:
                        metrics.observe_videos(1)
                        video = output.videos[0]
                        data = (await asyncio.to_thread(encode_video, video, fps, body.output_format)
                                if body.include_video else None)
                        yield _sse("video.stream.completed", {
                            "type": "video.stream.completed", "id": stream_id, "num_frames": len(video),
                            "seed": output.seed, "media_type": media_type,
                            "b64_data": to_base64(data) if data is not None else None,
                            "prompt_truncated": output.prompt_truncated,
                            "negative_prompt_truncated": output.negative_prompt_truncated,
                            "timings": output.metrics.as_dict()})
                    elif not watcher.disconnected and output is not None and output.error_param is not None:
                        yield _error_event(invalid_after_queueing(  # e.g. a --lora-dir file that did not load
                            output.error.removeprefix(f"{output.error_type}: "), output.error_param))
                    elif not watcher.disconnected:
                        message = (output.error if output is not None else event.error) or "the stream was aborted"
                        status = 503 if output is not None and output.status is RequestStatus.ABORTED else 500
                        yield _error_event(APIError(status, f"video stream failed: {message}",
                                                    type="server_error" if status == 500 else "service_unavailable",
                                                    code="generation_failed" if status == 500 else "request_aborted"))
                    return
        finally:
            with anyio.CancelScope(shield=True):  # also when Starlette cancels us (client gone)
                await watcher.stop()
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                await events.aclose()  # aborts the stream if it has not ended
                if not ended:
                    metrics.observe_abandoned(1)  # client gone or the stream cut: aborted in the engine

    # ----------------------------------------------------------------------- interaction
    async def interact(self, stream_id: str, raw_request: Request) -> JSONResponse:
        """Apply an interaction to a running stream.

        Raises:
            APIError: 404 unknown stream, 409 ended / no chunk left, 400 not a stream, a model
                without chunk streaming, or an invalid field; 503 not ready.
        """
        self.state.require_service()
        try:
            body: InteractionRequest = await _read_body(raw_request, InteractionRequest)  # type: ignore[assignment]
        except ClientDisconnect:
            return JSONResponse({}, status_code=CLIENT_CLOSED_REQUEST)
        try:
            event_id = self.state.engine.submit_interaction(stream_id, body.model_dump(exclude_none=True))
        except InteractionRefusedError as exc:
            status, code = REFUSAL_STATUS[exc.reason]
            raise APIError(status, str(exc), param="stream_id", code=code) from None
        except InvalidRequestError as exc:
            raise invalid_request(exc) from None
        return JSONResponse({"object": "video.stream.interaction", "stream_id": stream_id, "event_id": event_id})


def _error_event(error: APIError) -> str:
    return _sse("error", {"type": "error", **error.body()})


def install_video_stream_routes(app: FastAPI, state: Any) -> None:
    """Add ``POST /v1/videos/streams`` and ``POST /v1/videos/streams/{stream_id}/interactions``
    (see the module docstring) to `app`, serving `state`'s engine.

    Args:
        app: the FastAPI app, with the OpenAI error handlers installed.
        state: the server state (``engine``, ``model_name``, ``heartbeat_s``, ``draining``,
            ``require_service()``).
    """
    service = VideoStreamService(state)
    sse = {"text/event-stream": {"schema": sse_event_schema(
        [*STREAM_EVENTS, "error"], description="JSON with 'type' = the event name; the fields of each event are "
                                               "listed in diffserve.entrypoints.openai.services.video_streams")}}

    def errors(*codes: int) -> dict:
        return {code: {"model": ErrorResponse} for code in codes}

    @app.post(STREAMS_PATH, response_class=Response,
              responses={200: {"content": sse, "description": "The stream's events"},
                         **errors(400, 404, 408, 413, 415, 429, 503)},
              openapi_extra={"requestBody": {"required": True, "content": {
                  "application/json": {"schema": VideoStreamRequest.model_json_schema()}}}})
    async def start_video_stream(raw_request: Request) -> Response:
        """Start a video stream: chunks as Server-Sent Events as soon as each is generated."""
        return await service.start(raw_request)

    @app.post(STREAMS_PATH + "/{stream_id}/interactions", response_model=InteractionResponse,
              responses=errors(400, 404, 408, 409, 413, 415, 503),
              openapi_extra={"requestBody": {"required": True, "content": {
                  "application/json": {"schema": InteractionRequest.model_json_schema()}}}})
    async def post_interaction(stream_id: str, raw_request: Request) -> JSONResponse:
        """Change a running stream's prompt from its next chunk on (optionally over transition chunks)."""
        return await service.interact(stream_id, raw_request)
