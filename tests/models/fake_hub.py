"""A local HTTP server speaking the part of the Hugging Face Hub's HTTP API that
`huggingface_hub` uses to fetch a model (repository info, file tree, ``resolve`` downloads with
the commit and ETag headers), so the real library runs its online path end to end without a
network: point ``HF_ENDPOINT`` at `FakeHub.url`. It records every request (method, path,
Authorization header).

Errors as the Hub answers them: unknown repository -> 404 ``X-Error-Code: RepoNotFound``,
unknown file -> 404 ``EntryNotFound``, a gated repository without the right token -> 401
``GatedRepo``.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import threading
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class FakeRepo:
    """One repository: its files (path -> bytes) at one commit."""

    files: dict[str, bytes]
    sha: str = "c0ffee" * 6 + "0123"
    gated_token: str | None = None  # when set, only this bearer token may read it


def repo_from_folder(folder: Path, extra: dict[str, bytes] | None = None) -> FakeRepo:
    """A repository holding every file of `folder` (plus `extra`)."""
    files = {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
    return FakeRepo({**files, **(extra or {})})


@dataclass
class FakeHub:
    repos: dict[str, FakeRepo]
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)

    def __post_init__(self):
        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                self._answer(head=False)

            def do_HEAD(self):
                self._answer(head=True)

            def _send(self, status: int, body: bytes = b"", headers: dict | None = None, head: bool = False):
                self.send_response(status)
                for key, value in (headers or {}).items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if not head:
                    self.wfile.write(body)

            def _answer(self, head: bool):
                path = self.path.split("?")[0]
                hub.requests.append((self.command, path, self.headers.get("Authorization")))
                parts = path.strip("/").split("/")
                if parts[:2] == ["api", "models"] and len(parts) >= 4:
                    repo_id, rest = "/".join(parts[2:4]), parts[4:]
                else:
                    repo_id, rest = "/".join(parts[:2]), parts[2:]
                repo = hub.repos.get(repo_id)
                if repo is None:
                    return self._send(404, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"},
                                      head)
                if repo.gated_token and self.headers.get("Authorization") != f"Bearer {repo.gated_token}":
                    return self._send(401, b'{"error": "gated"}', {"X-Error-Code": "GatedRepo"}, head)
                json_headers = {"Content-Type": "application/json"}
                if parts[:2] == ["api", "models"] and "tree" in rest:
                    tree = [{"type": "file", "path": p, "size": len(d), "oid": hashlib.sha1(d).hexdigest()}
                            for p, d in repo.files.items()]
                    return self._send(200, json.dumps(tree).encode(), json_headers, head)
                if parts[:2] == ["api", "models"]:
                    info = {"id": repo_id, "sha": repo.sha, "siblings": [{"rfilename": p} for p in repo.files]}
                    return self._send(200, json.dumps(info).encode(), json_headers, head)
                if rest[:1] == ["resolve"]:
                    name = "/".join(rest[2:])
                    if name not in repo.files:
                        return self._send(404, b"", {"X-Error-Code": "EntryNotFound"}, head)
                    data = repo.files[name]
                    return self._send(200, data, {"X-Repo-Commit": repo.sha,
                                                  "ETag": f'"{hashlib.sha1(data).hexdigest()}"'}, head)
                return self._send(404, b"", {}, head)

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_port}"

    def downloaded(self, repo_id: str) -> set[str]:
        """Files of `repo_id` whose content was fetched (GET of a resolve URL)."""
        prefix = f"/{repo_id}/resolve/"
        return {path[len(prefix):].split("/", 1)[1] for method, path, _ in self.requests
                if method == "GET" and path.startswith(prefix)}

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
