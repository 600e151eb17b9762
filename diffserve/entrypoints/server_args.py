"""``diffserve serve`` options and their checks (no heavy imports: used before torch loads).

Security-related options:
    --api-key KEY (or env ``DIFFSERVE_API_KEY``): requests to ``/v1/*`` need
        ``Authorization: Bearer KEY`` (401 otherwise), as vLLM's ``--api-key``; ``/health``,
        ``/metrics``, the OpenAPI docs and the ``/v1/images/files/`` links (whose random names
        are capabilities) stay open unless ``--api-key-protect-all``.
    --allowed-origins: browser origins allowed by CORS (none by default: browsers may not read
        responses cross-site). JSON routes accept only ``Content-Type: application/json`` (415
        otherwise), so a cross-site form or ``text/plain`` POST is never served.
    --public-url: base of the ``url`` links of ``response_format="url"``; without it links use
        the address the connection was accepted on, never client-supplied Host /
        X-Forwarded-* headers.
    --allowed-hosts: the ``Host`` header values the server answers (400 otherwise), against DNS
        rebinding (a page of another site whose name was re-pointed at this server's address):
        by default, on a loopback address (127.0.0.1, ::1, localhost) the bound address and the
        localhost names; on any other address (0.0.0.0, ::, a public one) any host. The host of
        ``--public-url`` is always allowed.
    --enable-sleep-mode (an engine option): also serves ``POST /sleep``, ``POST /wake_up`` and
        ``GET /is_sleeping`` (behind ``--api-key``); without it they are not served (404).

Replicas (`diffserve.entrypoints.ray_serve`): ``--replicas N`` runs N engine replicas behind Ray
Serve, with ``--ray-address``, ``--autoscaling-config``, ``--max-ongoing-requests`` and
``--ray-actor-options``; these are checked here without importing Ray.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import re
import resource
from urllib.parse import urlsplit

from diffserve.core.errors import InvalidRequestError

#: Environment variable read when ``--api-key`` is not given.
API_KEY_ENV = "DIFFSERVE_API_KEY"
#: File descriptors of ``RLIMIT_NOFILE`` not given to ``--max-connections``: the connections
#: accepted only to be refused (`diffserve.entrypoints.openai.acceptor.REFUSAL_MARGIN`, 32) plus
#: 64 for the rest of the process (model files, logs, the listening socket, spilled images...).
RESERVED_FDS = 96


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``serve`` options (besides the engine options) to `parser`."""
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (0 = any free port)")
    parser.add_argument("--served-model-name", default=None, metavar="NAME",
                        help="model name in /v1/models and requests (default: the model folder's name, or "
                             "diffserve-NAME for a built-in model: diffserve-digits, diffserve-digits-video)")
    parser.add_argument("--max-waiting-requests", type=int, default=1024, metavar="N",
                        help="waiting-queue bound (one request per image); past it requests get 429")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="S",
                        help="on SIGTERM/SIGINT, seconds in-flight requests may finish before being aborted")
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                        help="server log level")
    parser.add_argument("--no-output-metadata", dest="output_metadata", action="store_false",
                        help="leave the generation parameters out of the images (PNG text chunks, JPEG/WebP "
                             "EXIF + XMP) and videos (MP4 tags) the server returns")
    auth = parser.add_argument_group("security")
    auth.add_argument("--api-key", default=None, metavar="KEY",
                      help=f"require 'Authorization: Bearer KEY' on /v1/* (default: ${API_KEY_ENV} when set, "
                           "else no authentication)")
    auth.add_argument("--api-key-protect-all", action="store_true",
                      help="with an API key: also protect /health, /metrics, the OpenAPI docs and the image "
                           "links (/v1/images/files/*)")
    auth.add_argument("--allowed-origins", default=None, metavar="ORIGINS",
                      help="comma-separated browser origins allowed by CORS, e.g. https://app.example.com, or * "
                           "(default: none, no CORS headers)")
    auth.add_argument("--public-url", default=None, metavar="URL",
                      help="base URL of response_format=url links, e.g. https://images.example.com (default: "
                           "http://ADDRESS:PORT the connection was accepted on)")
    auth.add_argument("--allowed-hosts", default=None, metavar="HOSTS",
                      help="comma-separated Host header names the server answers (400 otherwise; .example.com "
                           "also matches subdomains; * for any), against DNS rebinding (default: on a loopback "
                           "--host, that address and localhost, 127.0.0.1, ::1; else any host); the host of "
                           "--public-url is always allowed")
    conn = parser.add_argument_group("connections")
    conn.add_argument("--max-connections", type=int, default=512, metavar="N",
                      help="most connections served at once; a few more are answered 503 and closed, the rest "
                           "wait in the listen backlog until one closes (at most ulimit -n minus "
                           f"{RESERVED_FDS})")
    conn.add_argument("--header-timeout", type=float, default=10.0, metavar="S",
                      help="seconds for a request's line and headers to arrive (408 and close after)")
    conn.add_argument("--body-timeout", type=float, default=30.0, metavar="S",
                      help="seconds for a request's whole body to arrive after its headers (408 and close after)")
    conn.add_argument("--keep-alive-timeout", type=float, default=5.0, metavar="S",
                      help="seconds an idle connection is kept open after a response")
    conn.add_argument("--sse-heartbeat", type=float, default=15.0, metavar="S",
                      help="seconds between ': keep-alive' comments on a quiet event stream")
    urls = parser.add_argument_group("response_format=url images")
    urls.add_argument("--image-url-ttl", type=float, default=3600.0, metavar="S",
                      help="seconds a url image stays downloadable (kept that long, always)")
    urls.add_argument("--max-stored-images", type=int, default=4096, metavar="N",
                      help="most url images kept; when full, url requests get 503 until the oldest expire")
    urls.add_argument("--max-stored-bytes", type=int, default=256 * 2**20, metavar="BYTES",
                      help="most bytes of url images kept in memory (older ones spill to --image-store-dir)")
    urls.add_argument("--image-store-dir", default=None, metavar="DIR",
                      help="folder for url images beyond --max-stored-bytes; with --replicas, the store every "
                           "replica writes and reads all url images in (default: none, memory only; with "
                           "--replicas on a local Ray instance, a temporary folder)")
    urls.add_argument("--image-store-dir-bytes", type=int, default=4 * 2**30, metavar="BYTES",
                      help="most bytes of url images kept in --image-store-dir")
    videos = parser.add_argument_group("video jobs (POST /v1/videos)")
    videos.add_argument("--video-store-dir", default=None, metavar="DIR",
                        help="folder of the video jobs and their MP4s; replicas given the same folder share their "
                             "jobs (default: a private temporary folder, deleted at exit)")
    videos.add_argument("--video-ttl", type=float, default=3600.0, metavar="S",
                        help="seconds a video job and its MP4 stay available after the job ended (always that long)")
    videos.add_argument("--max-video-jobs", type=int, default=1000, metavar="N",
                        help="most video jobs kept (unfinished and ended); when full, new jobs get 503 until "
                             "the oldest expire")
    videos.add_argument("--max-video-bytes", type=int, default=4 * 2**30, metavar="BYTES",
                        help="most bytes of stored and reserved videos")
    ray = parser.add_argument_group("replicas (Ray Serve; pip install diffserve[ray])")
    ray.add_argument("--replicas", type=int, default=None, metavar="N",
                     help="run N engine replicas behind Ray Serve's HTTP proxy, each with its own engine and the "
                          "same API; url images go to --image-store-dir, shared by all replicas (default: one "
                          "server process, no Ray)")
    ray.add_argument("--ray-dashboard", action="store_true",
                     help="start Ray's dashboard with the local Ray instance (off: it takes ~1 GiB)")
    ray.add_argument("--ray-address", default=None, metavar="ADDR",
                     help="Ray cluster to run the replicas on (the address 'ray start --head' prints, or auto); "
                          "--image-store-dir is then required and must be on storage every node mounts (default: "
                          "a local Ray instance started for this server)")
    ray.add_argument("--autoscaling-config", default=None, metavar="JSON",
                     help="Ray Serve autoscaling_config as a JSON object, e.g. '{\"min_replicas\": 1, "
                          "\"max_replicas\": 4, \"target_ongoing_requests\": 16}'; --replicas is the initial "
                          "count (default: a fixed number of replicas)")
    ray.add_argument("--max-ongoing-requests", type=int, default=None, metavar="N",
                     help="most HTTP requests Ray Serve sends to one replica at once; more wait at the proxy for "
                          "the first replica with room (default: --max-batch-size)")
    ray.add_argument("--ray-actor-options", default=None, metavar="JSON",
                     help="Ray actor options of each replica as a JSON object, e.g. '{\"num_gpus\": 1}' "
                          "(default: num_cpus = --threads or 1; num_gpus = its ranks on a GPU cluster)")


def check_server_arguments(args: argparse.Namespace) -> None:
    """Check the ``serve`` options and resolve ``--api-key`` from the environment.

    Raises:
        InvalidRequestError: naming the option's field and its allowed range.
    """
    if not 0 <= args.port <= 65535:
        raise InvalidRequestError("port", args.port, "an integer in [0, 65535]")
    if args.max_waiting_requests < 1:
        raise InvalidRequestError("max_waiting_requests", args.max_waiting_requests, "an integer >= 1")
    if not args.shutdown_timeout >= 0:
        raise InvalidRequestError("shutdown_timeout", args.shutdown_timeout, "a number of seconds >= 0")
    for name in ("image_url_ttl", "header_timeout", "body_timeout", "keep_alive_timeout", "sse_heartbeat",
                 "video_ttl"):
        value = getattr(args, name)
        if not 0 < value < float("inf"):
            raise InvalidRequestError(name, value, "a number of seconds > 0")
    for name in ("max_stored_images", "max_stored_bytes", "image_store_dir_bytes", "max_video_jobs",
                 "max_video_bytes"):
        if getattr(args, name) < 1:
            raise InvalidRequestError(name, getattr(args, name), "an integer >= 1")
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    most = max(1, soft - RESERVED_FDS) if soft != resource.RLIM_INFINITY else 1 << 20
    if not 1 <= args.max_connections <= most:
        raise InvalidRequestError("max_connections", args.max_connections,
                                  f"an integer in [1, {most}] (the open-file limit is {soft}; raise it with ulimit -n)")
    if args.api_key is None:
        args.api_key = os.environ.get(API_KEY_ENV) or None
    if args.api_key is not None and (not args.api_key or not re.fullmatch(r"[\x21-\x7e]+", args.api_key)):
        raise InvalidRequestError("api_key", "<hidden>", "a non-empty key of printable ASCII without spaces")
    if args.api_key_protect_all and args.api_key is None:
        raise InvalidRequestError("api_key_protect_all", True, f"used with --api-key (or ${API_KEY_ENV})")
    if args.public_url is not None and not re.fullmatch(r"https?://[^\s/?#]+(/[^\s?#]*)?", args.public_url):
        raise InvalidRequestError("public_url", args.public_url, "an http(s) URL such as https://images.example.com")
    for host in (args.allowed_hosts or "").split(","):
        if args.allowed_hosts is not None and not re.fullmatch(r"\*|\.?[A-Za-z0-9._-]+|\[?[0-9A-Fa-f:.]+\]?",
                                                               host.strip()):
            raise InvalidRequestError("allowed_hosts", args.allowed_hosts,
                                      "comma-separated host names or addresses (no scheme or port), or *")
    if getattr(args, "wake_on_request", False) and not getattr(args, "enable_sleep_mode", False):
        raise InvalidRequestError("wake_on_request", True, "used with --enable-sleep-mode (the sleep routes)")
    for name in ("image_store_dir", "video_store_dir"):
        folder = getattr(args, name)
        if folder is not None and os.path.exists(folder) and not os.path.isdir(folder):
            raise InvalidRequestError(name, folder, "a folder")
    check_replica_arguments(args)


def check_replica_arguments(args: argparse.Namespace) -> None:
    """Check the Ray Serve replica options (Ray's own checks of the JSON options run when the
    deployment is built).

    Raises:
        InvalidRequestError: naming the option's field and its allowed range.
    """
    if args.replicas is None:
        for name in ("ray_address", "autoscaling_config", "max_ongoing_requests", "ray_actor_options"):
            if getattr(args, name) is not None:
                raise InvalidRequestError(name, getattr(args, name), "used with --replicas N")
        return
    if args.replicas < 1:
        raise InvalidRequestError("replicas", args.replicas, "an integer >= 1")
    if args.port == 0:  # Ray Serve's proxy listens on a port known in advance
        raise InvalidRequestError("port", 0, "an integer in [1, 65535] with --replicas")
    if args.max_ongoing_requests is not None and args.max_ongoing_requests < 1:
        raise InvalidRequestError("max_ongoing_requests", args.max_ongoing_requests, "an integer >= 1")
    for name in ("autoscaling_config", "ray_actor_options"):
        json_object(args, name)
    if args.ray_address is not None and args.image_store_dir is None:
        raise InvalidRequestError("image_store_dir", None, "a folder on storage every node of the Ray cluster mounts "
                                  "(NFS, ...), given with --ray-address: url images must be readable by every "
                                  "replica")


def json_object(args: argparse.Namespace, name: str) -> dict:
    """The option `name` parsed as a JSON object ({} when not given).

    Raises:
        InvalidRequestError: not a JSON object.
    """
    text = getattr(args, name)
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(name, text, "a JSON object", detail=str(exc)) from None
    if not isinstance(value, dict):
        raise InvalidRequestError(name, text, "a JSON object")
    return value


def allowed_origins(value: str | None) -> list[str]:
    """``--allowed-origins`` as a list (empty: CORS off)."""
    if not value:
        return []
    return [origin.strip().rstrip("/") for origin in value.split(",") if origin.strip()]


#: Names of this machine's loopback interface a local browser may send as ``Host``.
LOCALHOST_NAMES = ("localhost", "127.0.0.1", "::1")


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or ``localhost``) is a loopback address."""
    if host.lower().rstrip(".") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def allowed_hosts(args: argparse.Namespace) -> list[str] | None:
    """The ``Host`` allow-list of ``--allowed-hosts`` / its default (see the module
    docstring), with ``--public-url``'s host added; None: any host."""
    if args.allowed_hosts is not None:
        hosts = [h.strip() for h in args.allowed_hosts.split(",") if h.strip()]
        if "*" in hosts:
            return None
    elif is_loopback(args.host):
        hosts = [args.host, *LOCALHOST_NAMES]
    else:
        return None
    if args.public_url:
        hosts.append(urlsplit(args.public_url).hostname or "")
    return sorted({h.lower().strip("[]") for h in hosts if h})
