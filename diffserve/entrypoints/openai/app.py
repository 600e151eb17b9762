"""The OpenAI-compatible HTTP server's app: ``create_app`` builds the FastAPI app of ``diffserve
serve`` (its routes, middleware and the `ServerState` they share); the process around it (socket,
uvicorn, signals) is `diffserve.entrypoints.openai.server`.

Endpoints:
    POST /v1/images/generations   OpenAI Images API (JSON or Server-Sent Events), see
                                  `services.images` and `protocol` for fields and extensions
    POST /v1/images/edits         OpenAI image edits (multipart/form-data), see `services.edits`
    /v1/videos[/{id}[/content]]   OpenAI Videos API (jobs in a `stores.video_store`), see
                                  `services.videos`
    /v1/videos/streams            video streams: chunked video over SSE with mid-stream
                                  interactions, see `services.video_streams`
    GET  /v1/images/files/{name}  images of ``response_format="url"`` responses, kept for
                                  ``--image-url-ttl`` seconds (default 3600) as promised by each
                                  response's ``expires_at`` (see `stores.image_store`)
    GET  /v1/models[/{id}]        the served model (``--served-model-name``; default: the model
                                  folder's name, or ``diffserve-<name>`` for a built-in model)
    GET  /health                  200 once the model is loaded; 503 while loading, after a
                                  failed load, while shutting down and when the engine loop died
                                  (see `ops.health`)
    GET  /metrics                 Prometheus metrics (see `ops.metrics`)
    POST /sleep, /wake_up         sleep mode (see `ops.sleep`)
    GET  /                        the web playground (see `playground`)
    /v1/chat/completions, ...     OpenAI endpoints not served: a 404 saying so (see
                                  `unsupported_routes`)

Security (see `diffserve.entrypoints.server_args` and `middleware`): ``--api-key`` protects
``/v1/*`` with Bearer auth (401 in OpenAI's format); JSON routes take only ``Content-Type:
application/json`` (415 otherwise), form routes only ``multipart/form-data`` and no cross-site
browser posts (403, see `request_body`); CORS only for ``--allowed-origins``; ``url`` links
from ``--public-url`` or the accepting socket's address. Connections (see
`http_protocol`): header and body read timeouts (408), a connection limit (503),
half-closed clients answered, rate-limited connection logging.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response
from starlette.requests import ClientDisconnect

from diffserve.config import EngineConfig
from diffserve.engine.client import AsyncDiffusionEngine
from diffserve.entrypoints.model_name import model_name
from diffserve.entrypoints.openai.errors import (
    CLIENT_CLOSED_REQUEST,
    APIError,
    install_error_handlers,
    unavailable,
)
from diffserve.entrypoints.openai.middleware import ApiKeyAuth, CapabilityGate, HostAllowList, StatusCounter
from diffserve.entrypoints.openai.ops.health import install_health_route
from diffserve.entrypoints.openai.ops.metrics import ServerMetrics, install_metrics_route
from diffserve.entrypoints.openai.ops.loras import install_lora_routes
from diffserve.entrypoints.openai.ops.sleep import CONTROL_PATHS, install_sleep_routes
from diffserve.entrypoints.openai.playground import install_playground
from diffserve.entrypoints.openai.protocol import (
    ErrorResponse,
    ImageGenerationRequest,
    ImagesResponse,
    ModelCard,
    SSE_EVENT_SCHEMA,
    ModelList,
    model_tasks,
    request_json_schema,
)
from diffserve.entrypoints.openai.request_body import log_body_disconnect, read_json
from diffserve.entrypoints.openai.served_schema import GENERATIONS_PATH, capability_of, served_openapi
from diffserve.entrypoints.openai.services.edits import EDITS_PATH, install_edit_routes
from diffserve.entrypoints.openai.services.images import DEFAULT_HEARTBEAT_S, ImageGenerationService
from diffserve.entrypoints.openai.services.video_streams import STREAMS_PATH, install_video_stream_routes
from diffserve.entrypoints.openai.services.videos import VIDEOS_PATH, VideoService, install_video_routes
from diffserve.entrypoints.openai.stores.image_store import (
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_IMAGES,
    DEFAULT_MAX_SPILL_BYTES,
    DEFAULT_TTL_S,
    ImageStore,
)
from diffserve.entrypoints.openai.unsupported_routes import install_unsupported_routes
from diffserve.entrypoints.openai.stores.video_store import (
    DEFAULT_MAX_BYTES as DEFAULT_MAX_VIDEO_BYTES,
    DEFAULT_MAX_JOBS as DEFAULT_MAX_VIDEO_JOBS,
    DEFAULT_TTL_S as DEFAULT_VIDEO_TTL_S,
    LocalVideoStore,
    VideoStore,
)

logger = logging.getLogger(__name__)

#: Default bound on finishing in-flight requests at shutdown, seconds.
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0
FILES_PATH_PREFIX = "/v1/images/files/"
#: The POST routes that start generations (counted by status in the metrics).
GENERATION_PATHS = frozenset({GENERATIONS_PATH, EDITS_PATH, VIDEOS_PATH, STREAMS_PATH})
#: What to use instead, per capability, for the 404 of a capability the model lacks.
_INSTEAD = {"text-to-image": "the model generates videos: use POST /v1/videos",
            "image-edit": "the model takes no input images, so it cannot edit: use POST /v1/images/generations",
            "text-to-video": "the model generates images, not videos: use POST /v1/images/generations",
            "video-stream": "the model cannot stream video chunks"}


def default_served_model_name(config: EngineConfig) -> str:
    """The model name clients use: the model folder's name, or ``diffserve-<name>`` for a
    built-in model (``diffserve-digits``, ``diffserve-digits-video``)."""
    return model_name(config.model)


class ServerState:
    """What the routes share: the engine once loaded, the drain flag, metrics, the image store
    and the video jobs.

    Args:
        model_name: served model name.
        store / metrics: the app's image store and metrics.
        shutdown_timeout_s: how long in-flight requests may run once shutdown begins.
        video_store: where video jobs live.
    """

    def __init__(self, model_name: str, store: ImageStore, metrics: ServerMetrics, shutdown_timeout_s: float,
                 public_url: str | None = None, heartbeat_s: float = DEFAULT_HEARTBEAT_S,
                 video_store: VideoStore | None = None, output_metadata: bool = True):
        self.model_name = model_name
        self.store = store
        self.output_metadata = output_metadata
        self.video_store = video_store if video_store is not None else LocalVideoStore()
        #: video jobs (reads work from the store while the model loads; creating needs the engine)
        self.videos = VideoService(self.video_store, model_name, metrics, output_metadata=output_metadata)
        self.metrics = metrics
        self.shutdown_timeout_s = shutdown_timeout_s
        self.public_url = public_url
        self.heartbeat_s = heartbeat_s
        self._engine_death_logged = False
        self.created = int(time.time())
        self.engine: AsyncDiffusionEngine | None = None
        self.images: ImageGenerationService | None = None
        self.load_error: BaseException | None = None
        self.draining = False
        self._shutdown_lock = threading.Lock()
        self._engine_stopped = False
        #: whether ``--api-key`` protects a path (None: no key), for the served schema's 401s
        self.key_protects: Callable[[str], bool] | None = None
        #: whether a Host allow-list answers other hosts 400 (``--allowed-hosts``)
        self.checks_host = False

    @property
    def capabilities(self) -> set[str] | None:
        """What the loaded model serves: its tasks (`protocol.model_tasks`) plus
        ``video-stream`` when it can stream video chunks; None while it loads."""
        if self.images is None:
            return None
        engine = self.images.engine
        served = set(model_tasks(engine.spec))
        if engine.model_info.chunk_streaming:
            served.add("video-stream")
        return served

    def not_served(self, path: str, capability: str) -> str:
        """The message of the 404 for `path`, a route of `capability` the model lacks."""
        return (f"The model '{self.model_name}' does not serve {path}: {_INSTEAD[capability]} (GET /v1/models lists "
                "its capabilities).")

    @property
    def ready(self) -> bool:
        """The model is loaded and the server admits requests."""
        return self.images is not None and not self.draining

    def attach(self, engine: AsyncDiffusionEngine) -> None:
        """Start serving `engine` (starts its loop thread and its metrics)."""
        self.metrics.observe_engine(engine)
        engine.start()
        self.engine = engine
        self.images = ImageGenerationService(engine, self.model_name, self.store, self.metrics,
                                             lambda: self.draining, public_url=self.public_url,
                                             heartbeat_s=self.heartbeat_s, output_metadata=self.output_metadata)
        self.videos.attach(self.images)
        if self.draining:  # a shutdown began while the model was loading
            self.stop_engine()

    def load(self, loader: Callable[[], AsyncDiffusionEngine]) -> None:
        """Build the engine with `loader` and attach it; a failure is kept in `load_error`."""
        start = time.perf_counter()
        try:
            engine = loader()
        except BaseException as exc:  # noqa: BLE001 - reported by /health and run_server
            self.load_error = exc
            logger.error("model failed to load: %s", exc)
            return
        self.attach(engine)
        logger.info("model %r loaded in %.1fs", self.model_name, time.perf_counter() - start)

    def begin_shutdown(self) -> None:
        """Stop admitting now and drain the engine in a background thread (see `stop_engine`)."""
        if not self.draining:
            self.draining = True
            threading.Thread(target=self.stop_engine, name="diffserve-drain", daemon=True).start()

    def stop_engine(self) -> None:
        """Let in-flight requests finish for up to `shutdown_timeout_s` seconds, abort the rest
        and stop the engine thread. Idempotent; concurrent callers wait for the first."""
        self.draining = True
        with self._shutdown_lock:
            if self._engine_stopped or self.engine is None:
                return
            self.engine.shutdown(self.shutdown_timeout_s)
            self._engine_stopped = True

    def require_service(self) -> ImageGenerationService:
        """The generation service.

        Raises:
            APIError: 503 while loading, after a failed load, when shutting down, or when the
                engine loop died (``engine_dead``).
        """
        if self.draining:
            raise unavailable("the server is shutting down and accepts no new requests", "shutting_down")
        if self.images is None:
            if self.load_error is not None:
                raise unavailable(f"the model failed to load: {self.load_error}", "model_load_failed")
            raise unavailable("the model is still loading; retry shortly", "model_loading")
        if self.engine_dead:
            if not self._engine_death_logged:
                self._engine_death_logged = True
                logger.error("the engine loop thread is no longer running: /health and new requests answer 503")
            raise unavailable(self.images.engine_dead_message(), "engine_dead")
        return self.images

    @property
    def engine_dead(self) -> bool:
        """The engine was started and its loop thread stopped without a shutdown."""
        return self.engine is not None and not self._engine_stopped and not self.engine.is_running


def create_app(
    engine: AsyncDiffusionEngine | None,
    served_model_name: str,
    *,
    engine_loader: Callable[[], AsyncDiffusionEngine] | None = None,
    image_url_ttl_s: float = DEFAULT_TTL_S,
    max_stored_images: int = DEFAULT_MAX_IMAGES,
    max_stored_bytes: int = DEFAULT_MAX_BYTES,
    image_store_dir: str | Path | None = None,
    image_store_dir_bytes: int = DEFAULT_MAX_SPILL_BYTES,
    image_store: ImageStore | None = None,
    shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S,
    api_key: str | None = None,
    api_key_protect_all: bool = False,
    allowed_origins: list[str] | None = None,
    public_url: str | None = None,
    sse_heartbeat_s: float = DEFAULT_HEARTBEAT_S,
    wake_on_request: bool = False,
    video_store: VideoStore | None = None,
    video_store_dir: str | Path | None = None,
    video_ttl_s: float = DEFAULT_VIDEO_TTL_S,
    max_video_jobs: int = DEFAULT_MAX_VIDEO_JOBS,
    max_video_bytes: int = DEFAULT_MAX_VIDEO_BYTES,
    output_metadata: bool = True,
    enable_sleep_mode: bool | None = None,
    allowed_hosts: list[str] | None = None,
    lora_loading: bool | None = None,
) -> FastAPI:
    """Build the FastAPI app serving `engine` under the name `served_model_name`.

    The app owns the engine's lifetime while it runs: its lifespan starts the engine and, at
    exit, lets in-flight requests finish for up to `shutdown_timeout_s` seconds, aborts the
    rest and stops it. Every app has its own Prometheus registry, so several can coexist.

    Args:
        engine: a built engine; or None with `engine_loader`, which the lifespan calls in a
            background thread (``/health`` and requests get 503 until it returns).
        served_model_name: the model's name in ``/v1/models`` and the only accepted ``model``.
        engine_loader: builds the engine (loading the model); used when `engine` is None.
        image_url_ttl_s: seconds a ``response_format="url"`` image stays downloadable.
        max_stored_images: most images kept for URLs (url requests get 503 when full).
        max_stored_bytes: most bytes of url images kept in memory.
        image_store_dir / image_store_dir_bytes: folder (and its cap in bytes) for url images
            beyond `max_stored_bytes`; None keeps them in memory only.
        image_store: a store built by the caller (e.g. shared by replicas: `ImageStore` with
            ``shared=True``), used instead of the ``image_url_ttl_s``/``*_stored_*``/
            ``image_store_*`` arguments; the app closes it at exit.
        shutdown_timeout_s: bound on finishing in-flight requests at shutdown, seconds.
        api_key: when given, ``Authorization: Bearer api_key`` is required on ``/v1/*``.
        api_key_protect_all: require it on every path (``/health``, ``/metrics``, docs, links).
        allowed_origins: browser origins allowed by CORS (``["*"]`` for any); None/empty = no
            CORS headers.
        public_url: base of ``url`` links; None = the accepting socket's address.
        sse_heartbeat_s: seconds between ``: keep-alive`` comments on a quiet event stream.
        wake_on_request: a generation request wakes a sleeping engine instead of a 503
            (`diffserve.entrypoints.openai.ops.sleep`).
        video_store: where video jobs live (e.g. a store shared between replicas); None = a
            `LocalVideoStore` in `video_store_dir` (None: a private temporary folder) with
            `video_ttl_s`, `max_video_jobs` and `max_video_bytes`. The app closes it at exit.
        output_metadata: embed the generation parameters in every image (PNG text chunks, JPEG /
            WebP EXIF + XMP) and video (MP4 tags) the server returns
            (`diffserve.media.metadata`); False (``--no-output-metadata``) leaves them out.
        lora_loading: serve ``POST /v1/loras`` (loading LoRA adapters at run time, only from
            ``--lora-dir``); None = whether the engine's config has a ``lora_dir``.
        enable_sleep_mode: serve ``POST /sleep``, ``POST /wake_up`` and ``GET /is_sleeping``
            (``--enable-sleep-mode``); None: as `engine`'s config says (False with
            `engine_loader`).
        allowed_hosts: the ``Host`` header values (names or addresses, any port) the server
            answers; others get 400 (`middleware.HostAllowList`). None: any host.

    Raises:
        ValueError: neither or both of `engine` and `engine_loader` given, or a non-positive
            ttl/cap/timeout.
    """
    if (engine is None) == (engine_loader is None):
        raise ValueError("give exactly one of engine and engine_loader")
    if shutdown_timeout_s < 0:
        raise ValueError("shutdown_timeout_s must be >= 0")
    if not sse_heartbeat_s > 0:
        raise ValueError("sse_heartbeat_s must be > 0")
    metrics = ServerMetrics()
    store = image_store if image_store is not None else ImageStore(
        image_url_ttl_s, max_stored_images, max_stored_bytes, image_store_dir, image_store_dir_bytes)
    if video_store is None:
        video_store = LocalVideoStore(video_store_dir, video_ttl_s, max_video_jobs, max_video_bytes)
    state = ServerState(served_model_name, store, metrics, shutdown_timeout_s, public_url=public_url,
                        heartbeat_s=sse_heartbeat_s, video_store=video_store, output_metadata=output_metadata)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if engine is not None:
            state.attach(engine)
        else:
            threading.Thread(target=state.load, args=(engine_loader,), name="diffserve-model-loader",
                             daemon=True).start()
        yield
        state.draining = True
        await asyncio.get_running_loop().run_in_executor(None, state.stop_engine)
        await state.videos.close()  # unfinished jobs were aborted: let them write their outcome
        store.close()
        video_store.close()

    if enable_sleep_mode is None:
        enable_sleep_mode = engine is not None and engine.config.enable_sleep_mode
    app = FastAPI(title="diffserve", summary="OpenAI-compatible image generation server", lifespan=lifespan)
    app.state.diffserve = state
    install_error_handlers(app)
    install_sleep_routes(app, state, wake_on_request=wake_on_request, allowed_origins=allowed_origins,
                         public_url=public_url, routes=enable_sleep_mode)
    install_video_stream_routes(app, state)
    if lora_loading is None:
        lora_loading = engine is not None and engine.config.lora_dir is not None
    install_lora_routes(app, state, loading=lora_loading)
    app.add_middleware(StatusCounter, metrics=metrics, paths=GENERATION_PATHS)
    app.add_middleware(CapabilityGate, capability_of=capability_of, served=lambda: state.capabilities,
                       message=state.not_served)
    if api_key is not None:
        app.add_middleware(ApiKeyAuth, api_key=api_key, control_paths=CONTROL_PATHS, links_prefix=FILES_PATH_PREFIX,
                           protect_all=api_key_protect_all)
        state.key_protects = ApiKeyAuth(None, api_key, CONTROL_PATHS, FILES_PATH_PREFIX, api_key_protect_all).protects
    if allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=allowed_origins, allow_methods=["GET", "POST", "DELETE"],
                           allow_headers=["Authorization", "Content-Type"],
                           expose_headers=["X-Request-Id", "Retry-After"])
    if allowed_hosts is not None and "*" not in allowed_hosts:
        app.add_middleware(HostAllowList, allowed_hosts=allowed_hosts)  # outermost: before anything else
        state.checks_host = True
    errors = {code: {"model": ErrorResponse} for code in (400, 404, 408, 413, 415, 429, 500, 503)}
    sse = {"schema": SSE_EVENT_SCHEMA}

    @app.post(
        GENERATIONS_PATH,
        response_model=ImagesResponse,
        responses={**errors, 200: {"description": "An ImagesResponse, or a text/event-stream when "
                                                          "stream=true", "content": {"text/event-stream": sse}}},
        openapi_extra={"requestBody": {"required": True, "content": {
            "application/json": {"schema": request_json_schema()}}}},
    )
    async def create_image(raw_request: Request) -> Response:
        """Generate images (OpenAI Images API, plus diffserve's extension fields)."""
        service = state.require_service()
        try:
            body = await read_json(raw_request, ImageGenerationRequest)
        except ClientDisconnect:  # the client went away while sending the body: nobody to answer
            log_body_disconnect(raw_request)
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return await service.create(body, raw_request)

    images = {"content": {media: {"schema": {"type": "string", "format": "binary"}}
                          for media in ("image/png", "image/jpeg", "image/webp")}, "description": "The image"}

    @app.get("/v1/images/files/{name}", response_class=Response,
             responses={200: images, 404: {"model": ErrorResponse}})
    async def get_image_file(name: str) -> Response:
        """An image of a ``response_format="url"`` response, until it expires."""
        image = state.store.get(name)
        if image is None:
            raise APIError(404, f"No image file '{name}': unknown, or expired after {state.store.ttl_s:g}s.",
                           code="file_not_found")
        return Response(image.data, media_type=image.media_type, headers={"Cache-Control": "private, max-age=60"})

    def model_card() -> ModelCard:
        return ModelCard.describe(state.model_name, state.created,
                                  state.engine)

    @app.get("/v1/models", response_model=ModelList)
    async def list_models() -> ModelList:
        """The served model."""
        return ModelList(data=[model_card()])

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses={404: {"model": ErrorResponse}})
    async def get_model(model_id: str) -> ModelCard:
        """The served model by name; 404 for any other name."""
        if model_id != state.model_name:
            raise APIError(404, f"The model '{model_id}' does not exist.", param="model", code="model_not_found")
        return model_card()

    install_health_route(app, state)
    install_metrics_route(app, metrics)

    default_openapi = app.openapi

    def openapi() -> dict:
        """The OpenAPI schema as served for the loaded model (`served_schema.served_openapi`)."""
        app.openapi_schema = None  # rebuilt on each request: the model loads after the app starts
        return served_openapi(default_openapi(), state)

    app.openapi = openapi  # type: ignore[method-assign]
    install_edit_routes(app, state, allowed_origins, public_url)
    install_video_routes(app, state, allowed_origins, public_url)
    install_unsupported_routes(app)
    install_playground(app)
    return app
