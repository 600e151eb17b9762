"""diffserve's OpenAI-compatible HTTP server (``diffserve serve``).

- `api_server`: the FastAPI app (`create_app`) and the process entry (`run_server`).
- `protocol`: request/response schemas of the Images API plus diffserve's extension fields.
- `serving_images`: ``POST /v1/images/generations`` (JSON and Server-Sent Events).
- `errors`: errors in OpenAI's ``{"error": {...}}`` format and their HTTP status codes.
- `image_encoding`, `image_store`, `metrics`: PNG/JPEG/WebP encoding, the store behind
  ``response_format="url"`` (memory and a spill folder; a folder shared by replicas), and the
  Prometheus metrics.

The same app runs as N replicas behind Ray Serve: `diffserve.entrypoints.ray_serve`.
"""
