"""``python modelless_server.py LOOPS MAX_CONNECTIONS [HEADER_TIMEOUT]``: diffserve's HTTP server
(its app, `DiffserveServer`, acceptor and protocol, as ``diffserve serve`` runs them) whose model
never finishes loading, one per event loop in LOOPS (``asyncio,uvloop``), each on its own
127.0.0.1 port in a thread of this process. Prints one JSON line ``{loop: port}`` once all listen
and stops when stdin closes. ``/health`` answers 503 ``model_loading``; ``/metrics`` works.

For connection tests that need a separate process (its own ``RLIMIT_NOFILE``) without the cost
of loading a model; the log level is ``warning``, so the log holds only connection-level
messages (no access lines)."""

from __future__ import annotations

import json
import sys
import threading
import time

from diffserve.entrypoints.openai.app import create_app
from diffserve.entrypoints.openai.http_protocol import ConnectionLimits
from diffserve.entrypoints.openai.server import DiffserveServer, bind_listen_socket, uvicorn_config


def main(argv: list[str]) -> int:
    loops = argv[0].split(",")
    limits = ConnectionLimits(max_connections=int(argv[1]),
                              header_timeout_s=float(argv[2]) if len(argv) > 2 else 2.0)
    stop = threading.Event()

    def never_loads():
        stop.wait()
        raise RuntimeError("the server stopped before the model loaded")

    servers, threads, ports = [], [], {}
    for loop in loops:
        app = create_app(None, "m", engine_loader=never_loads)
        sock = bind_listen_socket("127.0.0.1", 0)
        server = DiffserveServer(uvicorn_config(app, "127.0.0.1", sock.getsockname()[1], limits=limits,
                                                log_level="warning", loop=loop),
                                 app.state.diffserve.metrics.connections)
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        servers.append(server)
        threads.append(thread)
        ports[loop] = sock.getsockname()[1]
    while not all(server.started for server in servers):
        time.sleep(0.01)
    print(json.dumps(ports), flush=True)
    sys.stdin.read()  # until the test closes our stdin
    stop.set()
    for server in servers:
        server.should_exit = True
    for thread in threads:
        thread.join(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
