"""diffserve's OpenAI-compatible HTTP server (``diffserve serve``).

- `api_server`: the FastAPI app (`create_app`) and the process entry (`run_server`).
- `protocol`: request/response schemas of the Images and Videos APIs plus diffserve's extension
  fields.
- `request_body`: reading JSON and ``multipart/form-data`` bodies (limits, validation).
- `serving_images`: ``POST /v1/images/generations`` and the edits' generation (JSON and
  Server-Sent Events); `request_group`: the engine requests of one HTTP request.
- `serving_edits`: ``POST /v1/images/edits`` (the multipart parser of the same service).
- `serving_videos`, `video_store`: the Videos API (``/v1/videos``) and its job store.
- `unsupported_routes`: OpenAI endpoints not served (404 saying so).
- `errors`: errors in OpenAI's ``{"error": {...}}`` format and their HTTP status codes.
- `image_encoding`, `image_store`, `metrics`: PNG/JPEG/WebP encoding, the store behind
  ``response_format="url"`` (memory and a spill folder; a folder shared by replicas), and the
  Prometheus metrics.

The same app runs as N replicas behind Ray Serve: `diffserve.entrypoints.ray_serve`.
"""
