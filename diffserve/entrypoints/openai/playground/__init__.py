"""The web playground: ``GET /`` serves one static page (HTML + CSS + vanilla JavaScript,
shipped as package data in ``static/``; no build step, nothing loaded from elsewhere) that
drives the public HTTP API only.

The page reads ``GET /v1/models`` and shows the form of each capability the model card lists
(``text-to-image`` -> ``POST /v1/images/generations``, ``image-edit`` -> ``POST
/v1/images/edits``, ``text-to-video`` -> ``POST /v1/videos``) with the parameters the card
lists (defaults and ranges from the card); images stream over Server-Sent Events with
``partial_images`` previews and diffserve's ``stream_progress`` events (queue place, steps).
Cancelling closes the stream, which aborts the request in the engine. A status strip polls
``GET /metrics``. When the server answers 401, the page asks for an API key once, keeps it in
the tab's ``sessionStorage`` and sends it as ``Authorization: Bearer``.

Routes (not part of the OpenAPI schema):
    GET /                       the page
    GET /playground/{file}      its script and style sheet
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

#: Folder of the page's files (package data).
STATIC_DIR = Path(__file__).with_name("static")
#: URL prefix of the page's script and style sheet.
ASSETS_PATH = "/playground"
#: The page talks to this server only: no other origin, no inline script or style.
CONTENT_SECURITY_POLICY = ("default-src 'self'; img-src 'self' data: blob:; media-src 'self' blob:; "
                           "style-src 'self'; script-src 'self'; connect-src 'self' blob:; object-src 'none'; "
                           "base-uri 'none'; frame-ancestors 'none'")


def install_playground(app: FastAPI) -> None:
    """Serve the playground page at ``GET /`` and its files under ``/playground/`` on `app`.

    Raises:
        FileNotFoundError: the package's ``static/`` folder is missing (a broken install).
    """
    index = STATIC_DIR / "index.html"
    if not index.is_file():
        raise FileNotFoundError(f"the playground page is missing from the package: {index}")

    @app.get("/", include_in_schema=False)
    async def playground() -> FileResponse:
        """The playground page."""
        return FileResponse(index, media_type="text/html",
                            headers={"Cache-Control": "no-cache", "Content-Security-Policy": CONTENT_SECURITY_POLICY})

    app.mount(ASSETS_PATH, StaticFiles(directory=STATIC_DIR), name="playground")
