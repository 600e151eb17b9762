"""The process of ``diffserve serve``: the listening socket, uvicorn with diffserve's HTTP
protocol, signals and the exit status, around the app of `diffserve.entrypoints.openai.app`.

Lifecycle: ``run_server`` binds the address first (when it cannot, it prints one line
``diffserve: error: cannot listen on HOST:PORT: REASON`` and returns 2 without loading
anything), starts listening and loads the model in a background thread (``/health`` says 503
meanwhile; a failed load stops the server with the load error). On
SIGTERM or SIGINT the server stops admitting requests (503 on open connections; the listening
socket closes), lets in-flight requests finish for up to ``--shutdown-timeout`` seconds, aborts
the rest (they get a 503), and exits with status 0. A second SIGINT stops waiting.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import signal
import socket
import sys
from collections.abc import Callable

import uvicorn
from fastapi import FastAPI
from uvicorn.config import STARTUP_FAILURE

from diffserve.config import EngineConfig
from diffserve.core.errors import InvalidRequestError
from diffserve.engine.client import AsyncDiffusionEngine
from diffserve.entrypoints.openai.app import (
    DEFAULT_SHUTDOWN_TIMEOUT_S,
    ServerState,
    create_app,
    default_served_model_name,
)
from diffserve.entrypoints.openai.acceptor import ConnectionAcceptor, ConnectionStats
from diffserve.entrypoints.openai.http_protocol import ConnectionLimits, protocol_class

logger = logging.getLogger(__name__)


class DiffserveServer(uvicorn.Server):
    """uvicorn's `Server` as ``diffserve serve`` runs it: connections accepted by a
    `ConnectionAcceptor` per socket (the descriptor bound of
    `diffserve.entrypoints.openai.acceptor`, on asyncio's loop and uvloop alike), counted in
    `connection_stats`; the first SIGTERM/SIGINT calls `on_shutdown_signal` (draining, see the
    module docstring) and the exit status stays 0 (uvicorn would re-raise the signal after
    shutting down). Run it with ``run(sockets=[...])`` (bound sockets; see `bind_listen_socket`).

    Args:
        config: from `uvicorn_config` (its ``http`` protocol class carries the limits).
        connection_stats: where the acceptors count (e.g. the app's
            ``ServerMetrics.connections``); None: a private one.
        on_shutdown_signal: called on the first SIGTERM/SIGINT.
    """

    def __init__(self, config: uvicorn.Config, connection_stats: ConnectionStats | None = None,
                 on_shutdown_signal: Callable[[], None] | None = None):
        super().__init__(config)
        self.connection_stats = connection_stats if connection_stats is not None else ConnectionStats()
        self._on_shutdown_signal = on_shutdown_signal
        self._signalled = False

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's startup (lifespan, protocol factory) with `ConnectionAcceptor` in place of
        the event loop's own server."""
        if not sockets:
            raise ValueError("DiffserveServer runs on bound sockets: run(sockets=[bind_listen_socket(...)])")
        await self.lifespan.startup()
        if self.lifespan.should_exit:
            sys.exit(STARTUP_FAILURE)
        config = self.config

        def create_protocol(_loop: asyncio.AbstractEventLoop | None = None) -> asyncio.Protocol:
            return config.http_protocol_class(config=config, server_state=self.server_state,  # type: ignore[call-arg]
                                              app_state=self.lifespan.state, _loop=_loop)

        limits = getattr(config.http_protocol_class, "limits", ConnectionLimits())
        self.servers = [ConnectionAcceptor(sock, create_protocol, limits, self.connection_stats, config.backlog)
                        for sock in sockets]  # type: ignore[misc]
        for acceptor in self.servers:
            acceptor.start()  # type: ignore[attr-defined]
        self.started = True

    def handle_exit(self, sig: int, frame) -> None:
        if self._on_shutdown_signal is None:
            super().handle_exit(sig, frame)
            return
        if self._signalled:
            if sig == signal.SIGINT:  # a second Ctrl-C: stop waiting for in-flight requests
                self.force_exit = True
            return
        self._signalled = True
        logger.info("received %s: draining (in-flight requests get up to the shutdown timeout)",
                    signal.Signals(sig).name)
        self._on_shutdown_signal()
        self.should_exit = True


def bind_listen_socket(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """A TCP socket bound to `host`:`port` (IPv6 when `host` contains ``:``; a host name is
    resolved) and listening with `backlog` (uvicorn's default), for `DiffserveServer`.

    Raises:
        OSError: the address cannot be bound (in use, not local, unresolvable host, ...).
    """
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
        sock.bind((host, port))
        sock.listen(backlog)  # connections wait in the backlog until the server accepts
    except BaseException:
        sock.close()
        raise
    return sock


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def uvicorn_config(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, *,
                   limits: ConnectionLimits = ConnectionLimits(), log_level: str = "info",
                   shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S, loop: str = "auto") -> uvicorn.Config:
    """The uvicorn configuration ``diffserve serve`` runs `app` with (in a `DiffserveServer`): the
    guarded h11 protocol of `diffserve.entrypoints.openai.http_protocol` with `limits`
    (timeouts, connection cap, half-close), lifespan on, on the event loop `loop` (uvicorn's
    names: ``auto`` = uvloop when installed, else asyncio's; ``asyncio``; ``uvloop``)."""
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on", loop=loop,
                          http=protocol_class(limits), timeout_keep_alive=limits.keep_alive_timeout_s,  # type: ignore[arg-type]
                          timeout_graceful_shutdown=int(shutdown_timeout_s) + 10)


def run_server(args: argparse.Namespace) -> int:
    """Run ``diffserve serve`` until SIGTERM/SIGINT.

    The address is bound before the model loads: when it cannot be, one line
    ``diffserve: error: cannot listen on HOST:PORT: REASON`` goes to stderr and nothing loads.

    Args:
        args: parsed ``serve`` arguments (`diffserve.entrypoints.cli_args.build_parser`): the
            engine options plus those of `diffserve.entrypoints.server_args.add_server_arguments`.

    Returns:
        0 after a graceful shutdown; 1 when the model failed to load with an unexpected error;
        2 (`diffserve.entrypoints.cli_args.EXIT_USAGE`) when the address cannot be listened on.

    Raises:
        InvalidRequestError: an invalid option (the CLI prints it and exits 2).
        UnsupportedModelError: the model folder cannot be served (the CLI exits 2).
    """
    from diffserve.entrypoints.cli_args import EXIT_USAGE
    from diffserve.entrypoints.engine_args import check_engine_arguments, engine_config_from_args
    from diffserve.core.library_warnings import silence_inapplicable_library_warnings
    from diffserve.entrypoints.server_args import check_server_arguments

    check_engine_arguments(args)
    check_server_arguments(args)
    limits = ConnectionLimits(max_connections=args.max_connections, header_timeout_s=args.header_timeout,
                              body_timeout_s=args.body_timeout, keep_alive_timeout_s=args.keep_alive_timeout)
    silence_inapplicable_library_warnings()
    config = dataclasses.replace(engine_config_from_args(args), max_waiting_requests=args.max_waiting_requests)
    name = args.served_model_name or default_served_model_name(config)
    logging.getLogger("diffserve").setLevel(args.log_level.upper())
    try:
        sock = bind_listen_socket(args.host, args.port)
    except OSError as exc:
        print(f"diffserve: error: cannot listen on {_address(args.host, args.port)}: {exc.strerror or exc}",
              file=sys.stderr)
        return EXIT_USAGE
    try:
        return _serve(args, config, name, sock, limits)
    finally:
        sock.close()  # uvicorn closes it at shutdown; this covers a failed start


def _serve(args: argparse.Namespace, config: EngineConfig, name: str, sock: socket.socket,
           limits: ConnectionLimits) -> int:
    """`run_server` once the listening socket is bound."""
    from diffserve.entrypoints.server_args import allowed_hosts, allowed_origins

    server = None

    def load_engine() -> AsyncDiffusionEngine:
        try:
            return AsyncDiffusionEngine(config)
        except BaseException:
            if server is not None:
                server.should_exit = True
            raise

    app = create_app(None, name, engine_loader=load_engine, image_url_ttl_s=args.image_url_ttl,
                     max_stored_images=args.max_stored_images, max_stored_bytes=args.max_stored_bytes,
                     image_store_dir=args.image_store_dir, image_store_dir_bytes=args.image_store_dir_bytes,
                     shutdown_timeout_s=args.shutdown_timeout, api_key=args.api_key,
                     api_key_protect_all=args.api_key_protect_all,
                     allowed_origins=allowed_origins(args.allowed_origins), public_url=args.public_url,
                     sse_heartbeat_s=args.sse_heartbeat, wake_on_request=args.wake_on_request,
                     video_store_dir=args.video_store_dir, video_ttl_s=args.video_ttl,
                     max_video_jobs=args.max_video_jobs, max_video_bytes=args.max_video_bytes,
                     output_metadata=args.output_metadata, enable_sleep_mode=config.enable_sleep_mode,
                     allowed_hosts=allowed_hosts(args), lora_loading=config.lora_dir is not None)
    state: ServerState = app.state.diffserve
    uv_config = uvicorn_config(app, args.host, args.port, limits=limits, log_level=args.log_level,
                               shutdown_timeout_s=args.shutdown_timeout)
    server = DiffserveServer(uv_config, state.metrics.connections, state.begin_shutdown)
    logger.info("serving %r on http://%s", name, _address(args.host, sock.getsockname()[1]))
    server.run(sockets=[sock])
    if state.load_error is not None:
        if isinstance(state.load_error, (InvalidRequestError, ValueError)):
            raise state.load_error
        logger.error("model failed to load: %r", state.load_error)
        return 1
    return 0
