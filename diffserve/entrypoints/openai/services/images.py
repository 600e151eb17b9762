"""``POST /v1/images/generations`` and ``POST /v1/images/edits``: a validated request becomes
``n`` engine requests, whose events become one JSON response or a stream of Server-Sent Events.

One service serves both endpoints; they differ only in how the request is parsed (JSON here,
``multipart/form-data`` with the input images in `services.edits`) and in the names of the
stream's events (``image_generation.*`` / ``image_edit.*``). An edit's engine requests carry the
input images (`diffserve.core.inputs`); its ``size="auto"`` is the first input's size rounded to the
model's resolution multiple (`diffserve.core.inputs.auto_size`), reported in the response.

- Image ``i`` of a request is its own engine request with seed ``(seed + i) mod 2**63`` (``seed`` drawn at
  random when not given; the engine's `InputProcessor`, shared with the CLI and the video
  routes), so each image is reproducible alone with ``n=1`` and its seed. The ``n`` requests
  are submitted together and share denoising steps (same batch key).
- Everything a client can get wrong is checked before anything is queued (400), ``n`` included:
  at most the engine's per-request image limit and at most its waiting-queue bound (a larger
  ``n`` could never be queued, so it is a 400, not a 429).
- The free room of the waiting queue is checked for all ``n`` requests before any is queued (and
  stays reserved until they are queued): a queue without room for all of them is a 429 and
  nothing is queued. Refused requests are admitted first come, first served when they retry
  (`services.admission`: room that frees is held for the oldest refused request). Should the engine still refuse part of the group, the queued part is
  aborted and the answer is a 429 too. Requests of a rejected group are not counted as engine
  requests in the metrics (the HTTP request is counted with status 429).
- A client that disconnects has its engine requests aborted at the next step boundary; the
  request is logged and counted with status 499.
- Streaming (``stream=true``) sends ``image_generation.partial_image`` events
  (``image_edit.partial_image`` for edits: previews decoded from the current latents after
  steps spread evenly over the run, ``partial_images`` per image), then one
  ``image_generation.completed`` (``image_edit.completed``) event per image, as OpenAI's API does; images
  are always base64 there. An engine failure mid-stream is sent as an ``error`` event. A quiet
  stream gets an SSE comment ``: keep-alive`` every ``heartbeat_s`` seconds (15 by default), so
  proxies do not cut it.
- ``response_format="url"``: room in the image store is reserved for all ``n`` images before
  anything is queued (503 with ``Retry-After`` when it is full; see `image_store`), so the
  stated ``expires_at`` always holds. Links start with the configured public URL, else with
  the address the connection was accepted on (never with client-supplied Host or
  X-Forwarded-* headers).
- If the engine loop dies, requests waiting on it fail within
  `request_groups.ENGINE_CHECK_INTERVAL_S` seconds with 503 ``engine_dead`` instead of waiting
  forever.
- With ``stream_progress=true`` the stream also carries diffserve's queue-place and step
  events (`diffserve.entrypoints.openai.services.sse_progress`), refreshed on every clock tick.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from diffserve.engine.client import EngineClient, ProcessedRequest
from diffserve.entrypoints.openai.http_protocol import CLIENT_EOF_KEY
from diffserve.entrypoints.openai.errors import (
    CLIENT_CLOSED_REQUEST,
    APIError,
    invalid_after_queueing,
    invalid_request,
    overloaded,
    unavailable,
)
from diffserve.media.image_encoding import MEDIA_TYPES, encode_image, to_base64
from diffserve.media.metadata import image_metadata
from diffserve.entrypoints.openai.stores.image_store import ImageStore, Reservation, StoreFullError, encoded_size_bound
from diffserve.entrypoints.openai.ops.metrics import ServerMetrics
from diffserve.entrypoints.openai.protocol import (
    scheduling_fields,
    CompletedEvent,
    ImageEditRequest,
    ImageGenerationRequest,
    ImageObject,
    ImagesResponse,
    PartialImageEvent,
    parse_size,
    preview_steps,
    request_json_schema,
    served_cache_qualities,
)
from diffserve.entrypoints.openai.request_body import CLIENT_DISCONNECTED_KEY
from diffserve.entrypoints.openai.services.admission import AdmissionLine, request_fingerprint
from diffserve.entrypoints.openai.services.request_groups import ENGINE_DEAD_MESSAGE, RequestGroup
from diffserve.entrypoints.openai.services.sse_progress import StreamProgress
from diffserve.core.errors import EngineDeadError, EngineOverloadedError, InvalidRequestError
from diffserve.core.inputs import RequestInputs
from diffserve.core.outputs import EventType, GenerationOutput, RequestStatus, StreamEvent
from diffserve.core.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

#: Default seconds between SSE keep-alive comments on a quiet stream.
DEFAULT_HEARTBEAT_S = 15.0
#: The SSE keep-alive comment (ignored by SSE clients).
HEARTBEAT = ": keep-alive\n\n"
#: Seconds between the keep-alive comments probing a streaming client after its EOF.
EOF_PROBE_INTERVAL_S = 0.25


@dataclass
class _Plan:
    """A validated request, ready to submit."""

    request_id: str
    created: int
    #: the engine requests, one per image (image i with seed + i)
    requests: list[ProcessedRequest]
    width: int
    height: int
    num_steps: int
    preview_steps: list[int]
    stream: bool
    stream_progress: bool
    response_format: str
    output_format: str
    compression: int | None
    quality: str
    inputs: RequestInputs | None = None
    #: prefix of the stream's event names: ``image_generation`` or ``image_edit``
    events: str = "image_generation"

    @property
    def size(self) -> str:
        return f"{self.width}x{self.height}"


class ImageGenerationService:
    """Serves image-generation and image-edit requests on one engine.

    Args:
        engine: the running engine.
        model_name: the served model's name (the only accepted ``model``).
        store: where ``response_format="url"`` images are kept.
        metrics: the server's Prometheus metrics.
        is_draining: returns True once the server is shutting down (requests get 503 then).
        public_url: base of ``url`` links (e.g. ``https://images.example.com``); None = the
            address the connection was accepted on.
        heartbeat_s: seconds between SSE keep-alive comments on a quiet stream.
        output_metadata: embed every image's generation parameters (as the CLI's files:
            `diffserve.media.metadata`) in its PNG text chunks or JPEG / WebP EXIF + XMP (the
            JSON, ``url`` and streamed ``completed`` images; previews carry none).
    """

    def __init__(self, engine: EngineClient, model_name: str, store: ImageStore,
                 metrics: ServerMetrics, is_draining: Callable[[], bool], public_url: str | None = None,
                 heartbeat_s: float = DEFAULT_HEARTBEAT_S, output_metadata: bool = True):
        self.engine = engine
        self.model_name = model_name
        self.store = store
        self.metrics = metrics
        self._is_draining = is_draining
        self.public_url = public_url.rstrip("/") if public_url else None
        self.heartbeat_s = heartbeat_s
        self.output_metadata = output_metadata
        #: Engine requests of HTTP requests that passed the queue-room check but are not queued yet.
        self._reserved = 0
        #: Requests refused for a full queue, in order, and the room held for them.
        self.admission = AdmissionLine()

    async def create(self, body: ImageGenerationRequest | ImageEditRequest, raw_request: Request,
                     inputs: RequestInputs | None = None, upload_digests: Sequence[bytes] = ()) -> Response:
        """Generate the images of `body` (an edit of `inputs` when given).

        Args:
            body: the validated request (`ImageGenerationRequest` or `ImageEditRequest`).
            raw_request: the HTTP request (for disconnects and the link base).
            inputs: the input images of an edit (`diffserve.core.inputs.make_inputs`), or None.
            upload_digests: digests of the uploaded files (part of the request's identity for
                `services.admission`).

        Returns:
            A JSON `ImagesResponse` (200), a ``text/event-stream`` response when streaming, or
            an empty 499 response when the client disconnected first (it gets nothing).

        Raises:
            APIError: 400 invalid field (also: inputs the family cannot use), 404 unknown model,
                429 queue full, 500 an engine failure, 503 shutting down, url
                image store full, or engine loop dead.
        """
        plan = self._plan(body, inputs)
        reservation = self._reserve_urls(plan)
        client = raw_request.client
        fingerprint = request_fingerprint(client.host if client else None, raw_request.url.path,
                                          body.model_dump_json(), upload_digests)
        try:
            return await self._create(plan, body, raw_request, reservation, fingerprint)
        finally:
            if reservation is not None:
                reservation.release()

    async def _create(self, plan: "_Plan", body: ImageGenerationRequest | ImageEditRequest, raw_request: Request,
                      reservation: Reservation | None, fingerprint: str) -> Response:
        group = self._group(plan)
        await self.submit(group, len(plan.requests), fingerprint)
        watcher = _DisconnectWatcher(raw_request.receive, group.abort)
        watcher.start()
        if body.user or body.safety_identifier:
            logger.debug("%s from user %r", plan.request_id, body.safety_identifier or body.user)
        if plan.stream:
            return _EventStreamResponse(
                self._stream(plan, group, watcher, raw_request),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "X-Request-Id": plan.request_id},
            )
        try:
            finals = await group.wait_all(self.engine_alive)
        finally:
            with anyio.CancelScope(shield=True):
                await watcher.stop()
                await group.close()
        outputs = [event.output for event in finals]
        if watcher.disconnected:
            self._log_disconnect(plan, raw_request)
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        self._raise_if_not_finished(finals)
        data = await asyncio.to_thread(self._encode_all, plan, outputs, self._link_base(raw_request), reservation)
        self.metrics.observe_images(len(data))
        response = ImagesResponse(id=plan.request_id, created=plan.created, data=data, size=plan.size,
                                  output_format=plan.output_format,
                                  quality=None if plan.quality == "auto" else plan.quality)
        logger.info("%s: %d image(s) %s, %d steps, %.3fs", plan.request_id, len(data), plan.size,
                    plan.num_steps, max(o.metrics.total_s for o in outputs))
        return JSONResponse(response.model_dump(), headers={"X-Request-Id": plan.request_id})

    # ------------------------------------------------------------------------- planning
    def _group(self, plan: _Plan) -> RequestGroup:
        """The engine requests of `plan` (not submitted yet)."""
        return RequestGroup(self.engine, plan.request_id, plan.requests, self.metrics,
                            preview_steps=plan.preview_steps,
                            progress=plan.stream_progress)  # only diffserve.progress SSE events read them

    def _plan(self, body: ImageGenerationRequest | ImageEditRequest, inputs: RequestInputs | None = None) -> _Plan:
        if body.model is not None and body.model != self.model_name:
            raise APIError(404, f"The model '{body.model}' does not exist; this server serves "
                                f"'{self.model_name}' (GET /v1/models).", param="model", code="model_not_found")
        engine = self.engine
        spec, config = engine.spec, engine.config
        if spec.default_num_frames is not None:
            raise APIError(400, f"The model '{self.model_name}' generates videos: use POST /v1/videos.",
                           param="model", code="invalid_value")
        if inputs is not None and not spec.accepts_images:
            raise APIError(400, f"The model '{self.model_name}' ({spec.pipeline}) takes no input images, so it "
                                "cannot edit: use POST /v1/images/generations.", param="image",
                           code="invalid_value")
        n = 1 if body.n is None else body.n
        max_n = min(config.limits.max_num_images_per_prompt, config.max_waiting_requests)
        if not 1 <= n <= max_n:
            raise APIError(400, f"invalid n={n}: must be an integer in [1, {max_n}] (at most "
                                f"{config.limits.max_num_images_per_prompt} images per request, and at most the "
                                f"server's waiting-queue bound of {config.max_waiting_requests} "
                                "requests: each image is one queued request)",
                           param="n", code="invalid_value")
        try:
            size = parse_size(body.size)
            width, height = size if size is not None else (None, None)
            params = SamplingParams(negative_prompt=body.negative_prompt, num_images_per_prompt=1, height=height,
                                    width=width, num_inference_steps=body.num_inference_steps,
                                    guidance_scale=body.guidance_scale, true_cfg_scale=body.true_cfg_scale,
                                    strength=getattr(body, "strength", None), seed=body.seed, output_type="pil",
                                    extra=body.extra_params, loras=body.loras, cache_quality=body.cache_quality,
                                    scheduler=body.scheduler, clip_skip=body.clip_skip, eta=body.eta,
                                    **scheduling_fields(body))
            # seeds, every check (the family's own rules on images, mask, strength too) and the plan, before
            # any allocation; an edit's "auto" size is the input's
            requests = engine.input_processor.process(body.prompt, params, inputs, n=n, size_from_inputs=True)
            engine.check_loras(requests[0].params.loras)  # known adapter names (a load starts for one not held)
        except InvalidRequestError as exc:
            raise invalid_request(exc) from None
        first = requests[0]
        stream = bool(body.stream)
        return _Plan(
            request_id=f"img-{uuid.uuid4().hex}",
            created=int(time.time()),
            requests=requests,
            width=first.params.width,
            height=first.params.height,
            num_steps=first.num_steps,  # the steps that run (image-to-image: the strength's share)
            preview_steps=preview_steps(first.num_steps, body.partial_images or 0) if stream else [],
            stream=stream,
            stream_progress=stream and bool(body.stream_progress),
            response_format=body.response_format or "b64_json",
            output_format=body.output_format or "png",
            compression=body.output_compression,
            quality=body.quality or "auto",
            inputs=inputs,
            events="image_generation" if inputs is None else "image_edit",
        )

    def _reserve_urls(self, plan: "_Plan") -> Reservation | None:
        """Hold room in the image store for the ``url`` images of `plan` (None otherwise).

        Raises:
            APIError: 503 ``image_store_full`` with ``Retry-After`` (full until stored images
                expire); 400 naming ``n`` or ``response_format`` when the store could never
                hold the request's images.
        """
        if plan.response_format != "url" or plan.stream:  # streamed images are always base64
            return None
        n = len(plan.requests)
        try:
            return self.store.reserve(n, n * encoded_size_bound(plan.width, plan.height))
        except InvalidRequestError as exc:
            raise invalid_request(exc) from None
        except StoreFullError as exc:
            error = unavailable(str(exc), "image_store_full")
            error.headers = {"Retry-After": str(exc.retry_after_s)}
            raise error from None

    def _link_base(self, raw_request: Request) -> str:
        """Base of ``url`` links: the public URL, else ``http://ADDRESS:PORT`` of the socket the
        connection was accepted on (not the client's Host / X-Forwarded-* headers)."""
        if self.public_url:
            return self.public_url
        server = raw_request.scope.get("server")
        if not server or server[1] is None:
            return ""
        host, port = server
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def request_schema(self) -> dict:
        """JSON schema of the request body with this server's model and engine limits."""
        config = self.engine.config
        return request_json_schema(self.engine.spec, config.limits,
                                   min(config.limits.max_num_images_per_prompt, config.max_waiting_requests),
                                   cache_qualities=served_cache_qualities(config))

    def engine_dead_message(self) -> str:
        """`ENGINE_DEAD_MESSAGE`, with the engine's reason when it gave one."""
        reason = getattr(self.engine, "error", None)
        return f"{ENGINE_DEAD_MESSAGE} ({reason})" if reason else ENGINE_DEAD_MESSAGE

    def engine_alive(self) -> bool:
        """Whether the engine loop is running."""
        return self.engine.is_running

    def check_queue_room(self, n: int, fingerprint: str | None = None) -> None:
        """Raise `EngineOverloadedError` unless the waiting queue has room for `n` more requests
        besides those other HTTP requests are about to queue (`_reserved`) and the room held
        for requests refused before (`admission`)."""
        free = self.engine.config.max_waiting_requests - self.engine.num_waiting - self._reserved
        if not self.admission.admit(fingerprint, n, free):
            raise EngineOverloadedError(
                f"waiting queue is full: room for {max(free, 0)} more request(s), this one needs {n} "
                "(one per image); retry later")

    async def submit(self, group: RequestGroup, n: int, fingerprint: str | None = None) -> None:
        """Queue the `n` requests of `group` (all or none; see `_submit`). Also used for video
        jobs, so images and videos share the waiting queue's room and its line
        (`fingerprint`: `admission.request_fingerprint` of the HTTP request, None = untracked).

        Raises:
            APIError: 400 an engine validation error, 429 the queue has no room for all of
                them, 503 shutting down or the engine loop died.
        """
        try:
            await self._submit(group, n, fingerprint)
        except InvalidRequestError as exc:
            raise invalid_request(exc) from None
        except EngineOverloadedError as exc:
            if self._is_draining():
                raise unavailable("the server is shutting down and accepts no new requests", "shutting_down") from None
            raise overloaded(exc) from None
        except EngineDeadError:
            raise unavailable(self.engine_dead_message(), "engine_dead") from None

    async def _submit(self, group: RequestGroup, n: int, fingerprint: str | None = None) -> None:
        """Check the queue has room for all `n` requests of `group`, then queue them.

        The room stays reserved from the check until the group's requests are in the engine's
        queue (`RequestGroup.submit` calls back then), so concurrent HTTP requests cannot
        take it in between; only the engine thread changes the queue otherwise, and it only
        frees room.
        """
        self.check_queue_room(n, fingerprint)
        self._reserved += n
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._reserved -= n

        try:
            await group.submit(on_queued=release, engine_alive=self.engine_alive)
        finally:
            release()

    # ------------------------------------------------------------------------- results
    def _raise_if_not_finished(self, finals: Sequence[StreamEvent]) -> None:
        for event in finals:
            output = event.output
            if output is not None and output.status is RequestStatus.FINISHED:
                continue
            if output is not None and output.status is RequestStatus.ABORTED:
                if self._is_draining():
                    raise unavailable("the server is shutting down; the request was aborted", "shutting_down")
                raise unavailable("the request was aborted", "request_aborted")
            message = output.error if output is not None else event.error
            if message == ENGINE_DEAD_MESSAGE or not self.engine_alive():
                raise unavailable(self.engine_dead_message(), "engine_dead")
            if output is not None and output.error_param is not None:
                raise invalid_after_queueing(message.removeprefix(f"{output.error_type}: "), output.error_param)
            raise APIError(500, f"image generation failed: {message}", type="server_error",
                           code="generation_failed")

    def _encode_all(self, plan: _Plan, outputs: Sequence[GenerationOutput], base_url: str,
                    reservation: Reservation | None) -> list[ImageObject]:
        data = []
        for output in outputs:
            encoded = self._encode_output(plan, output)
            item = ImageObject(seed=output.seed, prompt_truncated=output.prompt_truncated,
                               negative_prompt_truncated=output.negative_prompt_truncated,
                               timings=output.metrics.as_dict(), revised_prompt=output.ar_text)
            if reservation is not None:
                now = time.time()
                name, ttl_s = self.store.put(encoded, MEDIA_TYPES[plan.output_format], plan.output_format,
                                             reservation)
                item.url = f"{base_url}/v1/images/files/{name}"
                item.expires_at = int(now + ttl_s)  # rounded down: the image outlives it
            else:
                item.b64_json = to_base64(encoded)
            data.append(item)
        return data

    def _encode_output(self, plan: _Plan, output: GenerationOutput) -> bytes:
        """The finished image of `output` in the request's format, with its generation metadata
        (unless the server was started with ``--no-output-metadata``)."""
        metadata = None
        if self.output_metadata:
            used = output.params
            if plan.inputs is not None and used.strength is None:  # the strength the edit ran with
                used = dataclasses.replace(used, strength=self.engine.spec.default_strength)
            metadata = image_metadata(plan.requests[0].prompt, used, output.seed, self.model_name)
        return encode_image(output.images[0], plan.output_format, plan.compression, metadata)

    def _log_disconnect(self, plan: _Plan, raw_request: Request) -> None:
        raw_request.scope[CLIENT_DISCONNECTED_KEY] = True
        client = raw_request.client
        logger.info('%s:%s - "%s %s" %d client disconnected; %s aborted',
                    client.host if client else "-", client.port if client else "-", raw_request.method,
                    raw_request.url.path, CLIENT_CLOSED_REQUEST, plan.request_id)

    # ------------------------------------------------------------------------- streaming
    async def _stream(self, plan: _Plan, group: RequestGroup, watcher: "_DisconnectWatcher",
                      raw_request: Request) -> AsyncIterator[str]:
        partial_counts = [0] * len(plan.requests)
        completed = False
        common = dict(size=plan.size, quality=plan.quality, background="opaque", output_format=plan.output_format)
        loop = asyncio.get_running_loop()
        last_sent = loop.time()
        # A comment once heartbeat_s / 2 passed without a write (ticks come at least that
        # often): never more than heartbeat_s seconds between two writes. After the client's
        # EOF (a half-close, or a close), two comments right away probe whether it is still there.
        half = self.heartbeat_s / 2
        probes = 0
        progress = StreamProgress(self.engine, group.ids) if plan.stream_progress else None
        try:
            async for item in group.events(self.engine_alive, tick_s=min(half, EOF_PROBE_INTERVAL_S)):
                if item is None:
                    if progress is not None:
                        for payload in progress.on_tick():
                            yield _sse(payload["type"], payload)
                            last_sent = loop.time()
                    probe = probes < 2 and raw_request.scope.get(CLIENT_EOF_KEY, False)
                    if probe or loop.time() - last_sent >= half:
                        probes += bool(probe)
                        last_sent = loop.time()
                        yield HEARTBEAT
                    continue
                index, event = item
                if progress is not None:
                    for payload in progress.on_event(index, event):
                        yield _sse(payload["type"], payload)
                        last_sent = loop.time()
                if event.type is EventType.PARTIAL and event.preview:
                    encoded = await asyncio.to_thread(encode_image, event.preview[0], plan.output_format,
                                                      plan.compression)
                    partial = PartialImageEvent(type=f"{plan.events}.partial_image", b64_json=to_base64(encoded),
                                                created_at=int(time.time()),
                                                partial_image_index=partial_counts[index], image_index=index,
                                                **common)
                    partial_counts[index] += 1
                    yield _sse(partial.type, partial.model_dump())
                    last_sent = loop.time()
                elif event.type.is_final:
                    output = event.output
                    if output is not None and output.status is RequestStatus.FINISHED:
                        encoded = await asyncio.to_thread(self._encode_output, plan, output)
                        done = CompletedEvent(type=f"{plan.events}.completed", b64_json=to_base64(encoded),
                                              created_at=int(time.time()),
                                              image_index=index, seed=output.seed,
                                              prompt_truncated=output.prompt_truncated,
                                              negative_prompt_truncated=output.negative_prompt_truncated,
                                              timings=output.metrics.as_dict(), revised_prompt=output.ar_text,
                                              **common)
                        self.metrics.observe_images(1)
                        yield _sse(done.type, done.model_dump())
                        last_sent = loop.time()
                        continue
                    if watcher.disconnected:
                        return
                    try:
                        self._raise_if_not_finished([event])
                    except APIError as exc:
                        group.abort()
                        yield _sse("error", {"type": "error", **exc.body()})
                        completed = True
                        return
            completed = True
        finally:
            if not completed:  # the client went away (Starlette cancelled the stream) or aborted
                self._log_disconnect(plan, raw_request)
            with anyio.CancelScope(shield=True):  # cancellation is level-triggered in anyio
                await watcher.stop()
                await group.close()


class _EventStreamResponse(StreamingResponse):
    """A `StreamingResponse` that always closes its event generator when the response ends, so
    a client that disconnects mid-stream has its requests aborted and counted right away
    (Starlette cancels the sending task but leaves the generator to the garbage collector)."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


def _sse(event: str, data: dict) -> str:
    """One Server-Sent Event: ``event:`` line, one-line JSON ``data:``, blank line."""
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


class _DisconnectWatcher:
    """Waits for the client's ``http.disconnect`` (after the body was read) and then calls
    `on_disconnect` once."""

    def __init__(self, receive: Callable[[], Awaitable[dict]], on_disconnect: Callable[[], None]):
        self._receive = receive
        self._on_disconnect = on_disconnect
        self._task: asyncio.Task | None = None
        self.disconnected = False

    def start(self) -> None:
        self._task = asyncio.create_task(self._watch())

    async def _watch(self) -> None:
        while True:
            message = await self._receive()
            if message.get("type") == "http.disconnect":
                self.disconnected = True
                self._on_disconnect()
                return

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
