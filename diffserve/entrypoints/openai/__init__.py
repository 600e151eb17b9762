"""diffserve's OpenAI-compatible HTTP server (``diffserve serve``), one concept per module:

- `app`: the FastAPI app (`create_app`), its routes for image generations, image files and
  models, and the `ServerState` the routes share; `middleware`: status counting, API keys, the
  Host allow-list and the routes of capabilities the model lacks;
- `server`: the process around the app (listening socket, uvicorn, signals, exit status:
  `run_server`); `acceptor`: accepting connections within ``--max-connections`` (a bound on
  descriptors on any event loop); `http_protocol`: the HTTP transport (read timeouts, the
  refusal past the connection limit, half-closed clients);
- `protocol`: request/response schemas of the Images and Videos APIs plus diffserve's extension
  fields; `served_schema`: the OpenAPI schema as served for the loaded model; `errors`: errors
  in OpenAI's ``{"error": {...}}`` format and their status codes;
  `request_body`: reading JSON and ``multipart/form-data`` bodies (limits, validation);
- `services/`: the generation behind the routes (images, edits, videos, video streams, the
  engine requests of one HTTP request, SSE progress events, fair admission under a full queue);
- `stores/`: the images behind ``response_format="url"`` and the Videos API's jobs;
- `ops/`: ``/health``, ``/metrics`` (Prometheus) and sleep mode (``/sleep``, ``/wake_up``);
- `playground/`: the web page at ``/`` and its static files;
- `unsupported_routes`: OpenAI endpoints not served (404 saying so).

Image and video encoding live in `diffserve.media`; the server's command-line options in
`diffserve.entrypoints.server_args`. The same app runs as N replicas behind Ray Serve:
`diffserve.entrypoints.ray_serve`.
"""
