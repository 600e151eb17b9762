"""diffserve's OpenAI-compatible HTTP server (``diffserve serve``), one concept per module:

- `app`: the FastAPI app (`create_app`), its routes for image generations, image files and
  models, and the `ServerState` the routes share; `middleware`: status counting and API keys;
- `server`: the process around the app (listening socket, uvicorn, signals, exit status:
  `run_server`); `http_protocol`: the HTTP transport (read timeouts, connection limit,
  half-closed clients);
- `protocol`: request/response schemas of the Images and Videos APIs plus diffserve's extension
  fields; `errors`: errors in OpenAI's ``{"error": {...}}`` format and their status codes;
  `request_body`: reading JSON and ``multipart/form-data`` bodies (limits, validation);
- `services/`: the generation behind the routes (images, edits, videos, video streams, the
  engine requests of one HTTP request, SSE progress events);
- `stores/`: the images behind ``response_format="url"`` and the Videos API's jobs;
- `ops/`: ``/health``, ``/metrics`` (Prometheus) and sleep mode (``/sleep``, ``/wake_up``);
- `playground/`: the web page at ``/`` and its static files;
- `unsupported_routes`: OpenAI endpoints not served (404 saying so).

Image and video encoding live in `diffserve.media`; the server's command-line options in
`diffserve.entrypoints.server_args`. The same app runs as N replicas behind Ray Serve:
`diffserve.entrypoints.ray_serve`.
"""
