"""OpenAI's Videos API on a text-to-video model (``client.videos.create / retrieve /
download_content / delete / list`` in the official ``openai`` client).

Endpoints:
    POST   /v1/videos                 create a job (JSON, or ``multipart/form-data`` as the
                                      ``openai`` client sends it): answers at once with the job
                                      (``status="queued"``); the video is generated in the
                                      background as one engine request
    GET    /v1/videos/{id}            the job: ``status``, ``progress`` (percent of denoising
                                      steps), ``steps_done`` / ``num_inference_steps``,
                                      ``queue_position`` while queued, ``expires_at`` once ended
    GET    /v1/videos/{id}/content    the H.264 MP4 (``video/mp4``, streamed from the store), with
                                      the generation parameters as container tags; 409 until the
                                      job completed
    DELETE /v1/videos/{id}            aborts an unfinished job (at its next denoising step) and
                                      deletes the job and its video
    GET    /v1/videos                 jobs, newest first (``order=asc`` for oldest first), pages
                                      of ``limit`` (1-100, default 20) after the id ``after``

Length: ``seconds`` becomes ``num_frames`` = the nearest count the model allows to seconds x
the model's fps (Wan: 4k + 1 frames: 4 s at 16 fps -> 65 frames), at most `max_video_seconds`;
``num_frames`` (extension) sets it exactly, with any ``fps``. ``seconds`` comes alone (not with
``num_frames`` or ``fps``: its range is the model's frame limit at the model's rate, which the
served schema states). The job's ``seconds`` is the actual num_frames / fps. Other extensions: ``fps``,
``seed``, ``negative_prompt``, ``num_inference_steps``, ``guidance_scale``, ``guidance_scale_2``,
``true_cfg_scale``. Errors as for images: 400 naming the field, 404 unknown model or video, 429
queue full, 503 loading / shutting down / video store full (with ``Retry-After``); on an image
model every ``/v1/videos`` route answers 404 (saying so; the served OpenAPI schema leaves them
out, see `diffserve.entrypoints.openai.served_schema`).

Jobs live in a `VideoStore` (bounded count, bytes and time; a job's stated ``expires_at`` always
holds): any replica sharing the store answers the GET and DELETE routes, and a job deleted
through another replica is aborted by the one running it within `TICK_S` seconds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from typing import BinaryIO, Literal

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect

from diffserve.entrypoints.openai.errors import CLIENT_CLOSED_REQUEST, APIError, invalid_request, unavailable
from diffserve.entrypoints.openai.stores.image_store import StoreFullError
from diffserve.entrypoints.openai.ops.metrics import ServerMetrics
from diffserve.entrypoints.openai.protocol import (
    scheduling_fields,
    MAX_VIDEO_SECONDS,
    ErrorResponse,
    VideoCreateRequest,
    VideoDeleted,
    VideoError,
    VideoList,
    VideoObject,
    parse_size,
)
from diffserve.entrypoints.openai.request_body import (
    JSON,
    MULTIPART,
    check_form_origin,
    form_schema,
    log_body_disconnect,
    read_form,
    read_json,
    require_media_type,
)
from diffserve.entrypoints.openai.services.admission import request_fingerprint
from diffserve.entrypoints.openai.services.request_groups import ENGINE_DEAD_MESSAGE, RequestGroup
from diffserve.entrypoints.openai.stores.video_store import (
    LEASE_S,
    VIDEO_ID,
    VideoJob,
    VideoStore,
    encoded_video_bound,
    new_video_id,
)
from diffserve.media.metadata import video_metadata
from diffserve.media.video_encoding import encode_mp4
from diffserve.core.errors import InvalidRequestError
from diffserve.core.outputs import EventType, RequestStatus, StreamEvent
from diffserve.core.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

VIDEOS_PATH = "/v1/videos"
#: Seconds between a job's queue-place checks (and lease renewals, see `RENEW_S`) while it waits
#: or runs; also the longest a job deleted through another replica keeps running.
TICK_S = 0.5
#: Least seconds between two progress writes of a running job (status changes are written at once).
PROGRESS_WRITE_S = 0.25
#: Seconds between lease renewals of a job with nothing new to write.
RENEW_S = LEASE_S / 4
#: Largest page of ``GET /v1/videos``.
MAX_LIST_LIMIT = 100
#: Bytes per chunk when streaming a video.
CHUNK_BYTES = 1 << 16


def max_video_seconds(spec, limits) -> float:
    """The longest ``seconds`` a video request may ask for on a model with `spec` (a
    `ModelSpec`) and engine `limits`: its largest frame count at its default fps (capped at
    `protocol.MAX_VIDEO_SECONDS`). `frames_for_seconds` of anything up to it stays within the
    frame limit."""
    top = min(spec.max_num_frames or limits.max_num_frames, limits.max_num_frames)
    return min(top / spec.default_fps, MAX_VIDEO_SECONDS)


def frames_for_seconds(seconds: float, fps: int, frame_factor: int) -> int:
    """The frame count closest to `seconds` x `fps` that a model with `frame_factor` k allows
    (k*m + 1 frames when k > 1, e.g. Wan's 4m + 1; any count >= 1 otherwise)."""
    frames = seconds * fps
    if frame_factor > 1:
        return max(0, round((frames - 1) / frame_factor)) * frame_factor + 1
    return max(1, round(frames))


class VideoService:
    """Video jobs on one engine and one `VideoStore` (see the module docstring).

    The GET and DELETE operations need only the store (they work while the model loads);
    `create` needs the image service of the loaded engine (`attach`), whose waiting-queue room
    accounting videos share.

    Args:
        store: where jobs and videos live.
        model_name: the served model's name (the only accepted ``model``).
        metrics: the server's metrics.
        output_metadata: tag the MP4s with their generation parameters (container tags).
    """

    def __init__(self, store: VideoStore, model_name: str, metrics: ServerMetrics, output_metadata: bool = True):
        self.store = store
        self.model_name = model_name
        self.metrics = metrics
        self.output_metadata = output_metadata
        #: the loaded engine's `ImageGenerationService` (None until `attach`)
        self.images = None
        #: engine requests of this replica's unfinished jobs, by job id
        self._running: dict[str, RequestGroup] = {}
        self._tasks: set[asyncio.Task] = set()

    def attach(self, images) -> None:
        """Start creating jobs on the engine of `images` (an `ImageGenerationService`)."""
        self.images = images

    # ---------------------------------------------------------------------------- create
    async def create(self, body: VideoCreateRequest, fingerprint: str | None = None) -> VideoObject:
        """Validate `body`, store a queued job and queue its engine request (`fingerprint`:
        the request's place in the line of requests refused for a full queue, see
        `services.admission`).

        Raises:
            APIError: 400 invalid field, 404 unknown model, 429 queue full, 503 video store full
                (``Retry-After``), shutting down or engine dead.
        """
        images = self.images
        engine = images.engine
        spec = engine.spec
        if body.model is not None and body.model != self.model_name:
            raise APIError(404, f"The model '{body.model}' does not exist; this server serves "
                                f"'{self.model_name}' (GET /v1/models).", param="model", code="model_not_found")
        try:
            size = parse_size(body.size)
            width, height = size if size is not None else (None, None)
            num_frames = body.num_frames
            if body.seconds is not None:
                if num_frames is not None:
                    raise InvalidRequestError("seconds", body.seconds, "unset when num_frames is given (give one)")
                if body.fps is not None:
                    raise InvalidRequestError("fps", body.fps, f"unset with seconds (seconds are counted at the "
                                              f"model's {spec.default_fps} fps; give num_frames with fps)")
                longest = max_video_seconds(spec, engine.config.limits)
                if body.seconds > longest:
                    raise InvalidRequestError("seconds", body.seconds, f"a number of seconds in (0, {longest:g}] (at "
                                              f"most the model's frames at its {spec.default_fps} fps)")
                num_frames = frames_for_seconds(body.seconds, spec.default_fps, spec.frame_factor)
            params = SamplingParams(negative_prompt=body.negative_prompt, height=height, width=width,
                                    num_inference_steps=body.num_inference_steps, guidance_scale=body.guidance_scale,
                                    guidance_scale_2=body.guidance_scale_2, true_cfg_scale=body.true_cfg_scale,
                                    num_frames=num_frames, fps=body.fps, seed=body.seed, output_type="np",
                                    loras=body.loras, cache_quality=body.cache_quality, scheduler=body.scheduler,
                                    **scheduling_fields(body))
            [request] = engine.input_processor.process(body.prompt, params)  # seed, checks, plan
            engine.check_loras(request.params.loras)  # known adapter names (a load starts for one not held)
        except InvalidRequestError as exc:
            error = invalid_request(exc)
            if exc.field == "num_frames" and body.seconds is not None:
                error.param = "seconds"
                error.message += f" (from seconds={body.seconds:g} at {spec.default_fps} fps)"
            raise error from None
        prompt, resolved = request.prompt, request.params
        now = time.time()
        job = VideoJob(id=new_video_id(now), created_at=now, model=self.model_name, prompt=prompt,
                       width=resolved.width, height=resolved.height, num_frames=resolved.num_frames,
                       fps=resolved.fps, seed=resolved.seed, num_inference_steps=resolved.num_inference_steps,
                       reserved_bytes=encoded_video_bound(resolved.num_frames, resolved.width, resolved.height),
                       owner="")
        try:
            await asyncio.to_thread(self.store.create, job)
        except InvalidRequestError as exc:
            raise invalid_request(exc) from None
        except StoreFullError as exc:
            error = unavailable(str(exc), "video_store_full")
            error.headers = {"Retry-After": str(exc.retry_after_s)}
            raise error from None
        group = RequestGroup(engine, job.id, [request], self.metrics)
        try:
            await images.submit(group, 1, fingerprint)
        except BaseException:
            await asyncio.to_thread(self.store.delete, job.id)
            raise
        job.queue_position = engine.queue_position(group.ids[0])
        if job.queue_position is not None:  # the store holds the job as created: write its place now
            await asyncio.to_thread(self.store.update, job)
        self._running[job.id] = group
        task = asyncio.create_task(self._run(job, group, prompt))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        logger.info("%s: video %dx%d, %d frames, %d steps, queued", job.id, job.width, job.height, job.num_frames,
                    job.num_inference_steps)
        return self.render(job)

    async def _run(self, job: VideoJob, group: RequestGroup, prompt: str) -> None:
        """Follow the job's engine request: write its progress to the store, then its video (or
        its failure); abort it when the job was deleted."""
        loop = asyncio.get_running_loop()
        engine = self.images.engine
        last_write = loop.time()
        deleted = False
        stored_position = job.queue_position  # what the store says (written by `create`)

        async def save(force: bool) -> None:
            nonlocal last_write, deleted, stored_position
            if deleted or (not force and loop.time() - last_write < PROGRESS_WRITE_S):
                return
            last_write = loop.time()
            stored_position = job.queue_position
            if not await asyncio.to_thread(self.store.update, job):  # deleted (maybe through another replica)
                deleted = True
                group.abort()

        try:
            async for item in group.events(self.images.engine_alive, tick_s=TICK_S):
                if item is None:
                    job.queue_position = engine.queue_position(group.ids[0]) if job.status == "queued" else None
                    if job.queue_position != stored_position or loop.time() - last_write >= RENEW_S:
                        await save(force=True)
                    elif not deleted and await asyncio.to_thread(self.store.get, job.id) is None:
                        deleted = True  # deleted through another replica
                        group.abort()
                    continue
                _, event = item
                if event.type is EventType.STARTED:
                    job.status, job.queue_position = "in_progress", None
                    await save(force=True)
                elif event.type is EventType.PROGRESS:
                    job.status, job.queue_position = "in_progress", None
                    job.steps_done = event.step or 0
                    job.num_inference_steps = event.total or job.num_inference_steps
                    await save(force=False)
                elif event.type.is_final and not deleted:
                    await self._finish(job, event, prompt)
        except Exception:  # noqa: BLE001 - the job fails, the server goes on
            logger.exception("video job %s failed", job.id)
            job.status, job.error_code, job.error_message = "failed", "internal_error", "internal error (see the log)"
            await asyncio.to_thread(self.store.finish, job, None)
        finally:
            await group.close()
            self._running.pop(job.id, None)

    async def _finish(self, job: VideoJob, event: StreamEvent, prompt: str) -> None:
        output = event.output
        if output is not None and output.status is RequestStatus.FINISHED:
            metadata = video_metadata(prompt, output.params, output.seed, self.model_name) \
                if self.output_metadata else None
            try:
                data = await asyncio.to_thread(encode_mp4, output.videos[0], job.fps, metadata=metadata)
                job.status, job.steps_done, job.timings = "completed", job.num_inference_steps, output.metrics.as_dict()
                job.prompt_truncated = output.prompt_truncated
                job.negative_prompt_truncated = output.negative_prompt_truncated
                if await asyncio.to_thread(self.store.finish, job, data):
                    self.metrics.observe_videos(1)
                    logger.info("%s: video completed, %d bytes, %.3fs", job.id, len(data), output.metrics.total_s)
                return
            except ValueError as exc:
                job.error_code, job.error_message = "encoding_failed", f"the video could not be encoded: {exc}"
        elif output is not None and output.status is RequestStatus.ABORTED:
            job.error_code, job.error_message = "server_shutdown", "the server shut down before the job finished"
        else:
            message = (output.error if output is not None else None) or event.error or "generation failed"
            dead = message == ENGINE_DEAD_MESSAGE or not self.images.engine_alive()
            job.error_code = "engine_dead" if dead else (
                "invalid_value" if output is not None and output.error_param is not None else "generation_failed")
            job.error_message = self.images.engine_dead_message() if dead else message
        job.status = "failed"
        await asyncio.to_thread(self.store.finish, job, None)

    # ------------------------------------------------------------------------- read, delete
    def render(self, job: VideoJob) -> VideoObject:
        """The OpenAI ``Video`` object of `job` (times rounded down to whole seconds, so the
        stated ``expires_at`` is never later than the real expiry)."""
        if job.status == "completed":
            progress = 100
        else:
            progress = min(99, 100 * job.steps_done // job.num_inference_steps) if job.num_inference_steps else 0
        error = VideoError(code=job.error_code or "failed", message=job.error_message or "failed") \
            if job.status == "failed" else None
        return VideoObject(
            id=job.id, created_at=int(job.created_at),
            completed_at=None if job.completed_at is None else int(job.completed_at),
            expires_at=None if job.expires_at is None else int(job.expires_at),
            model=job.model, progress=progress, prompt=job.prompt, seconds=f"{job.num_frames / job.fps:g}",
            size=f"{job.width}x{job.height}", status=job.status, error=error, seed=job.seed,
            num_frames=job.num_frames, fps=job.fps, num_inference_steps=job.num_inference_steps,
            steps_done=job.steps_done, queue_position=job.queue_position if job.status == "queued" else None,
            timings=job.timings, prompt_truncated=job.prompt_truncated,
            negative_prompt_truncated=job.negative_prompt_truncated)

    async def retrieve(self, video_id: str) -> VideoObject:
        """The job `video_id`.

        Raises:
            APIError: 404 unknown, deleted or expired.
        """
        job = await asyncio.to_thread(self.store.get, video_id)
        if job is None:
            raise self._not_found(video_id)
        return self.render(job)

    async def content(self, video_id: str) -> tuple[VideoJob, BinaryIO]:
        """The job and an open file of its video (the caller closes it).

        Raises:
            APIError: 404 unknown, deleted or expired; 409 not completed (yet).
        """
        found = await asyncio.to_thread(self.store.open_content, video_id)
        if found is None:
            raise self._not_found(video_id)
        job, handle = found
        if handle is None:
            what = "failed" if job.status == "failed" else f"is {job.status.replace('_', ' ')}"
            raise APIError(409, f"The video '{video_id}' has no content: the job {what}.", param="video_id",
                           code="video_not_ready" if job.active else "video_failed")
        return job, handle

    async def delete(self, video_id: str) -> VideoDeleted:
        """Delete the job `video_id` and its video, aborting it when it is unfinished (here at
        once, on another replica at its next tick).

        Raises:
            APIError: 404 unknown, deleted or expired.
        """
        job = await asyncio.to_thread(self.store.delete, video_id)
        if job is None:
            raise self._not_found(video_id)
        group = self._running.get(video_id)
        if group is not None:
            group.abort()
        return VideoDeleted(id=video_id)

    async def list(self, after: str | None, limit: int, order: str) -> VideoList:
        """A page of jobs (see `VideoStore.list`). The cursor `after` is a video id (it need not
        exist any more: ids sort by creation time, so a page after an expired job still follows it).

        Raises:
            ValueError: `after` is not a video id (the route checks its pattern first).
        """
        if after is not None and not VIDEO_ID.fullmatch(after):
            raise ValueError(f"after={after!r} is not a video id")
        jobs, more = await asyncio.to_thread(self.store.list, after, limit, order)
        data = [self.render(job) for job in jobs]
        return VideoList(data=data, first_id=data[0].id if data else None, last_id=data[-1].id if data else None,
                         has_more=more)

    async def close(self, timeout_s: float = 30.0) -> None:
        """Wait (up to `timeout_s` seconds) for the jobs' tasks to write their outcome; call
        once the engine stopped (its unfinished requests were aborted)."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout_s)

    def _not_found(self, video_id: str) -> APIError:
        return APIError(404, f"No video '{video_id}': unknown, deleted, or expired ({self.store.ttl_s:g}s after it "
                             "ended).", param="video_id", code="video_not_found")


def _chunks(handle: BinaryIO) -> Iterator[bytes]:
    try:
        while chunk := handle.read(CHUNK_BYTES):
            yield chunk
    finally:
        handle.close()


def install_video_routes(app: FastAPI, state, allowed_origins: list[str] | None = None,
                         public_url: str | None = None) -> None:
    """Add the Videos API routes (see the module docstring) to an app built by
    `diffserve.entrypoints.openai.app.create_app`.

    Args:
        app: the FastAPI app (its OpenAI error handlers installed).
        state: the server state: ``require_service()`` (503 while loading or shutting down)
            and ``videos`` (the `VideoService`).
        allowed_origins / public_url: the server's, for the cross-site form check.
    """
    def errors(*codes: int) -> dict:
        return {code: {"model": ErrorResponse} for code in codes}

    mp4 = {200: {"content": {"video/mp4": {"schema": {"type": "string", "format": "binary"}}},
                 "description": "The MP4 video"}}
    create_schema = VideoCreateRequest.model_json_schema()
    create_form = form_schema(create_schema, {})

    @app.post(VIDEOS_PATH, response_model=VideoObject,
              responses=errors(400, 403, 404, 408, 413, 415, 429, 503),
              openapi_extra={"requestBody": {"required": True, "content": {
                  JSON: {"schema": create_schema}, MULTIPART: {"schema": create_form}}}})
    async def create_video(raw_request: Request) -> Response:
        """Create a video job (OpenAI Videos API, plus diffserve's extension fields)."""
        images = state.require_service()
        if images.engine.spec.default_num_frames is None:  # not in the served schema either
            raise APIError(405, f"The model '{images.model_name}' generates images, not videos: POST /v1/videos "
                                "is not served (use POST /v1/images/generations).", code="method_not_allowed",
                           headers={"Allow": "GET"})
        kind = require_media_type(raw_request, (JSON, MULTIPART))
        try:
            if kind == JSON:
                body = await read_json(raw_request, VideoCreateRequest, check_type=False)
            else:
                check_form_origin(raw_request, allowed_origins, public_url)
                form = await read_form(raw_request, {"input_reference"})
                if form.files:
                    raise APIError(400, "Invalid value for 'input_reference': not supported (the served video "
                                        "models are text-to-video).", param="input_reference", code="invalid_value")
                body = form.validate(VideoCreateRequest)
        except ClientDisconnect:
            log_body_disconnect(raw_request)
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        state.require_service()  # still admitting once the body arrived
        client = raw_request.client
        video = await state.videos.create(body, request_fingerprint(client.host if client else None, VIDEOS_PATH,
                                                                    body.model_dump_json()))
        return JSONResponse(video.model_dump(), headers={"X-Request-Id": video.id})

    @app.get(VIDEOS_PATH, response_model=VideoList, responses=errors(400))
    async def list_videos(after: str | None = Query(None, pattern=f"^{VIDEO_ID.pattern}$",
                                                    description="a video id ('last_id' of the previous page)"),
                          limit: int = Query(20, ge=1, le=MAX_LIST_LIMIT),
                          order: Literal["asc", "desc"] = "desc") -> VideoList:
        """Video jobs, newest first (``order=asc``: oldest first), ``limit`` per page after ``after``."""
        return await state.videos.list(after, limit, order)

    @app.get(VIDEOS_PATH + "/{video_id}", response_model=VideoObject, responses=errors(404))
    async def retrieve_video(video_id: str) -> VideoObject:
        """A video job: status, progress, and (once ended) expiry."""
        return await state.videos.retrieve(video_id)

    @app.get(VIDEOS_PATH + "/{video_id}/content", response_class=Response,
             responses={**errors(400, 404, 409), **mp4})
    async def video_content(video_id: str, variant: Literal["video"] = "video") -> Response:
        """The MP4 of a completed job (``variant``: only ``video``; no thumbnail or spritesheet)."""
        job, handle = await state.videos.content(video_id)
        return StreamingResponse(_chunks(handle), media_type=job.media_type, headers={
            "Content-Length": str(job.content_bytes), "Content-Disposition": f'inline; filename="{job.id}.mp4"',
            "Cache-Control": "private, max-age=60"})

    @app.delete(VIDEOS_PATH + "/{video_id}", response_model=VideoDeleted, responses=errors(404))
    async def delete_video(video_id: str) -> VideoDeleted:
        """Abort an unfinished job, delete a finished one (and its video)."""
        return await state.videos.delete(video_id)

