"""A stand-in for the Hugging Face Hub on loopback (HF_ENDPOINT): enough of its HTTP API for
huggingface_hub's model_info / snapshot_download and the API's config.json check, serving
checkpoint folders as repositories, some of them readable only with one token. Every request
is recorded with its Authorization header, so tests see which token went where."""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

SHA = "0123456789abcdef0123456789abcdef01234567"


@dataclass
class Repo:
    folder: Path
    token: str | None = None  # None: public


@dataclass
class Seen:
    method: str
    path: str
    auth: str | None


@dataclass
class FakeHub:
    repos: dict[str, Repo]
    seen: list[Seen] = field(default_factory=list)
    url: str = ""
    _server: ThreadingHTTPServer | None = None

    def start(self) -> FakeHub:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # http.server's names
                hub._answer(self, body=True)

            def do_HEAD(self) -> None:
                hub._answer(self, body=False)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        return self

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def auths(self, repo: str) -> set[str | None]:
        """The Authorization headers of every request about `repo`."""
        return {s.auth for s in self.seen if f"/{repo}/" in s.path + "/"}

    # ------------------------------------------------------------ answers

    def _answer(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(urlsplit(h.path).path)
        auth = h.headers.get("Authorization")
        self.seen.append(Seen(h.command, path, auth))
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"] and len(parts) >= 4:
            repo_id, rest = "/".join(parts[2:4]), parts[4:]
            if rest and rest[0] == "tree":
                return self._tree(h, repo_id, auth, body)
            if rest and rest[0] != "revision":
                return self._send(h, 404, b'{"error": "not here"}', body)
            return self._info(h, repo_id, auth, body)
        if len(parts) >= 5 and parts[2] == "resolve":
            return self._file(h, "/".join(parts[:2]), "/".join(parts[4:]), auth, body)
        return self._send(h, 404, b'{"error": "not here"}', body)

    def _allowed(
        self, h: BaseHTTPRequestHandler, repo_id: str, auth: str | None, body: bool
    ) -> Repo | None:
        repo = self.repos.get(repo_id)
        if repo is None or (repo.token is not None and auth != f"Bearer {repo.token}"):
            # What the Hub answers for a repository that is missing or private to the caller.
            self._send(
                h, 401, b'{"error": "Repository Not Found"}', body, {"X-Error-Code": "RepoNotFound"}
            )
            return None
        return repo

    @staticmethod
    def _files(repo: Repo) -> list[str]:
        return sorted(
            p.relative_to(repo.folder).as_posix() for p in repo.folder.rglob("*") if p.is_file()
        )

    def _tree(self, h: BaseHTTPRequestHandler, repo_id: str, auth: str | None, body: bool) -> None:
        repo = self._allowed(h, repo_id, auth, body)
        if repo is None:
            return
        entries = []
        for f in self._files(repo):
            data = (repo.folder / f).read_bytes()
            entries.append(
                {
                    "type": "file",
                    "path": f,
                    "size": len(data),
                    "oid": hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest(),
                }
            )
        self._send(h, 200, json.dumps(entries).encode(), body)

    def _info(self, h: BaseHTTPRequestHandler, repo_id: str, auth: str | None, body: bool) -> None:
        repo = self._allowed(h, repo_id, auth, body)
        if repo is None:
            return
        files = self._files(repo)
        info = {
            "id": repo_id,
            "modelId": repo_id,
            "sha": SHA,
            "private": repo.token is not None,
            "gated": False,
            "disabled": False,
            "tags": [],
            "downloads": 0,
            "likes": 0,
            "lastModified": "2026-12-01T00:00:00.000Z",
            "createdAt": "2026-12-01T00:00:00.000Z",
            "siblings": [{"rfilename": f, "size": (repo.folder / f).stat().st_size} for f in files],
        }
        self._send(h, 200, json.dumps(info).encode(), body)

    def _file(
        self, h: BaseHTTPRequestHandler, repo_id: str, rel: str, auth: str | None, body: bool
    ) -> None:
        repo = self._allowed(h, repo_id, auth, body)
        if repo is None:
            return
        p = repo.folder / rel
        if ".." in Path(rel).parts or not p.is_file():
            return self._send(
                h,
                404,
                b'{"error": "Entry not found"}',
                body,
                {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": SHA},
            )
        data = p.read_bytes()
        etag = hashlib.sha256(data).hexdigest()
        self._send(
            h,
            200,
            data,
            body,
            {"X-Repo-Commit": SHA, "ETag": f'"{etag}"', "Content-Type": "application/octet-stream"},
        )

    @staticmethod
    def _send(
        h: BaseHTTPRequestHandler,
        status: int,
        data: bytes,
        body: bool,
        headers: dict[str, str] | None = None,
    ) -> None:
        h.send_response(status)
        for k, v in (headers or {}).items():
            h.send_header(k, v)
        if "Content-Type" not in (headers or {}):
            h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if body:
            h.wfile.write(data)
