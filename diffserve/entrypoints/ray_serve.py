"""Engine replicas behind Ray Serve: ``diffserve serve --replicas N``, or Ray's own
``serve run`` with `build_app`.

Each replica is a Ray actor (`DiffusionReplica`) that builds its own `AsyncDiffusionEngine` in
its constructor and serves the same OpenAI-compatible FastAPI app as ``diffserve serve``
(`diffserve.entrypoints.openai.app.create_app`) through Ray Serve's FastAPI ingress
(``@serve.ingress``; late-bound: ``__serve_build_asgi_app__`` builds the app around the
replica's own engine, after the constructor). Ray Serve's HTTP proxy (one per node by default)
accepts the connections and hands each request to a replica. Nothing here is cluster code of
our own: placement, routing, health checks, restarts and autoscaling are Ray Serve's.

Routing (Ray Serve's default request router, "power of two choices"): for each request the
proxy picks two replicas at random and sends the request to the one with fewer requests ongoing
(its queue length, as the replicas report it), never more than ``max_ongoing_requests`` to one
replica; requests beyond that wait at the proxy and go to the first replica with room. The
default ``max_ongoing_requests`` is the engine's ``--max-batch-size`` (rows per denoising step):
a replica then holds enough requests to fill a step batch (for CFG models, whose images take 2
rows each, a running batch and a waiting one), while the rest wait at the router, free to go to
whichever replica frees up first, instead of queueing behind one engine. An HTTP request with
``n`` images counts as one ongoing request.

Autoscaling (``--autoscaling-config JSON``): Ray Serve's ``autoscaling_config`` as given
(``min_replicas``, ``max_replicas``, ``target_ongoing_requests``, delays, ...); ``--replicas`` is
then ``initial_replicas`` and ``target_ongoing_requests`` defaults to ``max_ongoing_requests``
(scale up once replicas run full batches and requests queue at the router).

Replica identity: every response carries ``X-Diffserve-Replica: ID``, Ray Serve's id of the
replica that served it (the end of its actor name ``SERVE_REPLICA::diffserve#diffserve#ID``).

``url`` images: every replica's `ImageStore` is in shared mode on one folder
(``--image-store-dir``): an image is written there at once and any replica serves any link,
also after the replica that wrote it stopped or died (see `image_store`). ``diffserve serve
--replicas N`` on a local Ray instance uses a temporary folder when none is given (deleted at
exit); on a cluster (``--ray-address``, ``serve run``) the folder is required and must be on
storage every node mounts.

Failures: Ray Serve calls each replica's `DiffusionReplica.check_health` (every 10 s); a replica
whose engine loop died fails it and is replaced. When a replica's process dies, requests in
flight on it are answered by the proxy at once with HTTP 500 (plain text ``Internal Server
Error``; OpenAI's clients retry 5xx answers), requests not yet handed to it go to the other
replicas, and Ray Serve starts a replacement.

Metrics: ``/metrics`` answers for every replica, whichever serves the scrape: each replica
publishes its metrics to ``<image store dir>/metrics/`` and merges all of them, each series with a
``replica`` label plus the sum as ``replica="all"`` (`diffserve.entrypoints.openai.ops.replica_metrics`).

A local Ray instance starts without Ray's dashboard (its processes took ~1 GiB of the 3.13 GiB
two replicas used; `benchmarks/ray_memory.py`) unless ``--ray-dashboard``.

What differs from the single-process server: the connection options (``--max-connections``,
``--header-timeout``, ``--body-timeout``) belong to diffserve's own HTTP server and do not apply
to Ray's proxy (``--keep-alive-timeout`` is passed to it); ``/health`` and the sleep routes
answer for the replica that serves the request (named by the header).
"""

from __future__ import annotations

import argparse
import copy
import logging
import math
import os
import shutil
import signal
import sys
import tempfile
import threading
from typing import Any

import ray
from pydantic import ValidationError
from ray import serve
from ray.serve.config import AutoscalingConfig

from diffserve.core.errors import InvalidRequestError

logger = logging.getLogger(__name__)

#: Name of the Ray Serve application and of its deployment.
APP_NAME = "diffserve"
#: Response header naming the replica that served a request.
REPLICA_HEADER = "X-Diffserve-Replica"
#: Seconds Ray Serve waits beyond ``--shutdown-timeout`` before killing a stopping replica.
SHUTDOWN_MARGIN_S = 10.0


@serve.ingress()
class DiffusionReplica:
    """One engine replica: loads the model in its constructor, then serves the
    OpenAI-compatible app around that engine (`__serve_build_asgi_app__`).

    Args:
        args: the parsed and checked ``diffserve serve`` options (`parse_serve_options`); the
            engine options build the `EngineConfig`, the server options the app.

    Raises:
        InvalidRequestError / UnsupportedModelError: the engine options or the model folder
            (Ray Serve reports the deployment as failed).
    """

    def __init__(self, args: argparse.Namespace):
        import dataclasses

        from diffserve.engine.client import AsyncDiffusionEngine
        from diffserve.entrypoints.engine_args import engine_config_from_args
        from diffserve.core.library_warnings import silence_inapplicable_library_warnings

        silence_inapplicable_library_warnings()
        logging.getLogger("diffserve").setLevel(args.log_level.upper())
        self._args = args
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        config = dataclasses.replace(engine_config_from_args(args), max_waiting_requests=args.max_waiting_requests)
        self.engine = AsyncDiffusionEngine(config)
        self._state = None

    def __serve_build_asgi_app__(self):
        """The app of ``diffserve serve`` around this replica's engine, with a shared url image
        store and the `REPLICA_HEADER` on every response."""
        from diffserve.entrypoints.openai.app import create_app, default_served_model_name
        from diffserve.entrypoints.openai.stores.image_store import ImageStore
        from diffserve.entrypoints.server_args import allowed_hosts, allowed_origins
        from diffserve.entrypoints.openai.stores.video_store import LocalVideoStore

        args = self._args
        store = ImageStore(args.image_url_ttl, args.max_stored_images, args.max_stored_bytes,
                           spill_dir=args.image_store_dir, max_spill_bytes=args.image_store_dir_bytes, shared=True)
        videos = LocalVideoStore(shared_video_store_dir(args), args.video_ttl, args.max_video_jobs,
                                 args.max_video_bytes, replica=self.replica_id)
        name = args.served_model_name or default_served_model_name(self.engine.config)
        app = create_app(self.engine, name, image_store=store, video_store=videos,
                         shutdown_timeout_s=args.shutdown_timeout,
                         api_key=args.api_key, api_key_protect_all=args.api_key_protect_all,
                         allowed_origins=allowed_origins(args.allowed_origins), public_url=args.public_url,
                         sse_heartbeat_s=args.sse_heartbeat, wake_on_request=args.wake_on_request,
                         output_metadata=args.output_metadata, allowed_hosts=allowed_hosts(args))
        app.add_middleware(_ReplicaHeader, replica_id=self.replica_id)
        self._state = app.state.diffserve
        from diffserve.entrypoints.openai.ops.replica_metrics import ReplicaMetrics

        metrics = self._state.metrics
        self._metrics = ReplicaMetrics(os.path.join(args.image_store_dir, "metrics"), self.replica_id, metrics.render)
        metrics.set_view(self._metrics.render)
        self._metrics.start()
        return app

    def check_health(self) -> None:
        """Ray Serve's periodic health check.

        Raises:
            RuntimeError: the engine loop died (Ray Serve then replaces this replica).
        """
        if self._state is not None and self._state.engine_dead:
            raise RuntimeError(f"replica {self.replica_id}: the engine loop stopped: {self.engine.error}")


class _ReplicaHeader:
    """ASGI middleware adding ``X-Diffserve-Replica: replica_id`` to every HTTP response."""

    def __init__(self, app, replica_id: str):
        self.app = app
        self._header = (REPLICA_HEADER.lower().encode(), replica_id.encode())

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_header(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self._header]}
            await send(message)

        await self.app(scope, receive, send_with_header)


# ------------------------------------------------------------------------------- options
def max_ongoing_requests(args: argparse.Namespace) -> int:
    """``--max-ongoing-requests``, by default ``--max-batch-size`` (see the module docstring)."""
    return args.max_ongoing_requests if args.max_ongoing_requests is not None else args.max_batch_size


def autoscaling_config(args: argparse.Namespace) -> dict | None:
    """Ray Serve's ``autoscaling_config`` from ``--autoscaling-config`` (None without it), with
    ``initial_replicas`` = ``--replicas`` and ``target_ongoing_requests`` =
    `max_ongoing_requests` unless given.

    Raises:
        InvalidRequestError: Ray Serve refuses it (unknown key, min > max, ...), with its reason.
    """
    from diffserve.entrypoints.server_args import json_object

    if args.autoscaling_config is None:
        return None
    config = json_object(args, "autoscaling_config")
    config.setdefault("initial_replicas", args.replicas)
    config.setdefault("target_ongoing_requests", max_ongoing_requests(args))
    unknown = sorted(set(config) - set(AutoscalingConfig.model_fields))
    try:
        if unknown:  # Ray Serve would ignore them silently
            raise ValueError(f"unknown key(s) {', '.join(unknown)}; known: {', '.join(AutoscalingConfig.model_fields)}")
        AutoscalingConfig(**config)
    except (ValidationError, ValueError, TypeError) as exc:
        reason = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'config'}: {e['msg']}" for e in exc.errors()) \
            if isinstance(exc, ValidationError) else str(exc)
        raise InvalidRequestError("autoscaling_config", args.autoscaling_config,
                                  "a Ray Serve autoscaling_config (min_replicas, max_replicas, "
                                  "target_ongoing_requests, ...) whose range holds --replicas",
                                  detail=reason) from None
    return config


def actor_options(args: argparse.Namespace, cluster_has_gpus: bool) -> dict:
    """Ray actor options of each replica: ``num_cpus`` = ``--threads`` (1 by default),
    ``num_gpus`` = the engine's ranks (``--cfg-parallel-size`` x ``--ulysses-degree``) when it
    runs on CUDA (``--device cuda...``, or ``auto`` on a cluster with GPUs), then
    ``--ray-actor-options`` on top."""
    from diffserve.entrypoints.server_args import json_object

    options: dict[str, Any] = {"num_cpus": args.threads or 1}
    if args.device.startswith("cuda") or (args.device == "auto" and cluster_has_gpus):
        options["num_gpus"] = args.cfg_parallel_size * args.ulysses_degree
    options.update(json_object(args, "ray_actor_options"))
    return options


def replica_application(args: argparse.Namespace) -> serve.Application:
    """The Ray Serve application of `args`: the `DiffusionReplica` deployment with its
    replicas (or autoscaling), ``max_ongoing_requests``, actor options and graceful shutdown
    bound, ready for ``serve.run``. Call it once connected to Ray (it asks the cluster whether
    it has GPUs).

    Raises:
        InvalidRequestError: an invalid replica option.
    """
    args = copy.copy(args)
    cluster_has_gpus = ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0
    actor = actor_options(args, cluster_has_gpus)
    if args.threads is None and isinstance(actor.get("num_cpus"), (int, float)) and actor["num_cpus"] >= 1:
        args.threads = int(actor["num_cpus"])  # one torch thread per CPU Ray reserves for the replica
    options: dict[str, Any] = {
        "name": APP_NAME,
        "max_ongoing_requests": max_ongoing_requests(args),
        "ray_actor_options": actor,
        "graceful_shutdown_timeout_s": args.shutdown_timeout + SHUTDOWN_MARGIN_S,
    }
    scaling = autoscaling_config(args)
    if scaling is not None:
        options["autoscaling_config"] = scaling
    else:
        options["num_replicas"] = args.replicas
    return serve.deployment(DiffusionReplica, **options).bind(args)


def http_options(args: argparse.Namespace) -> dict:
    """Ray Serve's HTTP proxy options: ``--host``, ``--port``, ``--keep-alive-timeout`` (whole
    seconds, rounded up)."""
    return {"host": args.host, "port": args.port, "keep_alive_timeout_s": max(1, math.ceil(args.keep_alive_timeout))}


def parse_serve_options(options: dict[str, Any]) -> argparse.Namespace:
    """``diffserve serve`` options given as a dict (Ray's ``serve run`` args) parsed and
    checked as on the command line: key ``image_store_dir`` or ``image-store-dir`` is
    ``--image-store-dir``; a value true is a bare flag, false or None leaves it out.

    Raises:
        InvalidRequestError: an invalid option (as ``diffserve serve`` would report it).
    """
    from diffserve.entrypoints.cli_args import build_parser
    from diffserve.entrypoints.engine_args import check_engine_arguments
    from diffserve.entrypoints.server_args import check_server_arguments

    argv = ["serve"]
    for key, value in options.items():
        flag = "--" + str(key).replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is not False and value is not None:
            argv += [flag, str(value)]
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit:  # argparse printed the reason
        raise InvalidRequestError("args", options, "diffserve serve options (see the message above)") from None
    check_engine_arguments(args)
    check_server_arguments(args)
    return args


def shared_video_store_dir(args: argparse.Namespace) -> str:
    """The video job folder every replica shares: ``--video-store-dir``, else the ``videos``
    subfolder of the shared url image folder (the image store leaves names it did not write
    alone), so a job created through one replica is read, downloaded and deleted through any."""
    return args.video_store_dir or os.path.join(args.image_store_dir, "videos")


def build_app(options: dict[str, Any]) -> serve.Application:
    """Ray Serve application builder for Ray's own CLI, e.g. ``serve run
    diffserve.entrypoints.ray_serve:build_app replicas=2 image-store-dir=/shared/diffserve``
    or a ``serve run``/``serve deploy`` config file whose ``import_path`` names it (see
    ``deploy/ray_serve.yaml``). `options` are ``diffserve serve`` options (`parse_serve_options`);
    ``replicas`` defaults to 1 and ``image_store_dir`` (a folder every node mounts) is required.
    ``host``/``port`` do not apply: the config file's ``http_options`` set the proxy's.

    Raises:
        InvalidRequestError: an invalid option, or no ``image_store_dir``.
    """
    options = {"replicas": 1, **options}
    args = parse_serve_options(options)
    if args.image_store_dir is None:
        raise InvalidRequestError("image_store_dir", None, "a folder on storage every node of the Ray cluster "
                                  "mounts: url images must be readable by every replica")
    return replica_application(args)


# ----------------------------------------------------------------------------------- CLI
def _replica_error() -> str | None:
    """The last line of the error Ray Serve reports for the deployment (the exception a replica
    raised, e.g. ``diffserve.core.errors.UnsupportedModelError: ...``), or None."""
    try:
        message = serve.status().applications[APP_NAME].deployments[APP_NAME].message
    except Exception:  # noqa: BLE001 - no status to add
        return None
    lines = [line.strip() for line in (message or "").splitlines() if line.strip()]
    return lines[-1] if lines else None


def run_replicas(args: argparse.Namespace) -> int:
    """Run ``diffserve serve --replicas N`` until SIGTERM/SIGINT: connect to (or start) Ray,
    start Ray Serve's proxy on ``--host``:``--port``, deploy the replicas, wait, then delete
    the application (replicas finish in-flight requests for up to ``--shutdown-timeout``
    seconds) and stop what was started.

    Args:
        args: parsed and checked ``serve`` options with ``--replicas`` set.

    Returns:
        0 after a signal; 1 when the replicas failed to start; 2 (``EXIT_USAGE``) when the
        address cannot be listened on (local Ray instance only: a cluster's proxy binds on its
        own node).

    Raises:
        InvalidRequestError: an invalid option (the CLI prints it and exits 2).
    """
    from diffserve.entrypoints.cli_args import EXIT_USAGE
    from diffserve.entrypoints.engine_args import engine_config_from_args
    from diffserve.entrypoints.openai.server import bind_listen_socket

    autoscaling_config(args)  # Ray Serve's checks, then the engine options' own, before starting anything
    config = engine_config_from_args(args)
    logging.getLogger("diffserve").setLevel(args.log_level.upper())
    if args.ray_address is None:  # the replicas run on this machine: check their model folder here
        from diffserve.models.model_index import read_model_index

        read_model_index(config.model_path)
        try:
            bind_listen_socket(args.host, args.port).close()
        except OSError as exc:
            print(f"diffserve: error: cannot listen on {args.host}:{args.port}: {exc.strerror or exc}",
                  file=sys.stderr)
            return EXIT_USAGE
    temporary_dir = None
    if args.image_store_dir is None:
        temporary_dir = args.image_store_dir = tempfile.mkdtemp(prefix="diffserve-ray-images-")
    stop = threading.Event()
    previous: dict = {}
    submitted = False
    try:
        # "local": a new instance, never one found running; without the dashboard unless asked for
        ray.init(address=args.ray_address or "local",
                 **({} if args.ray_address else {"include_dashboard": bool(args.ray_dashboard)}))
        # after ray.init, whose native handler would abort the process on SIGTERM
        previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
        serve.start(http_options=http_options(args))
        application = replica_application(args)
        submitted = True
        try:
            serve.run(application, name=APP_NAME, route_prefix="/", blocking=False)
        except Exception as exc:  # noqa: BLE001 - any failure of Ray's deployment
            print(f"diffserve: error: the replicas failed to start: {_replica_error() or exc}", file=sys.stderr)
            return 1
        logger.info("serving %d replica(s) on http://%s:%d (Ray Serve; url images in %s)", args.replicas,
                    args.host, args.port, args.image_store_dir)
        while not stop.wait(1.0):
            pass
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if ray.is_initialized():
            if submitted:  # also a failed deployment, which would stay on a cluster
                serve.delete(APP_NAME)
            if args.ray_address is None:
                serve.shutdown()
            ray.shutdown()
        if temporary_dir is not None:
            shutil.rmtree(temporary_dir, ignore_errors=True)
