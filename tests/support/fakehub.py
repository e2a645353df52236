"""A fake Hugging Face Hub on 127.0.0.1: a real HTTP server in a thread that speaks as much of
the hub's HTTP API as huggingface_hub's `hf_hub_download`, `list_repo_files` and
`snapshot_download` use, serving one repository whose files are a local directory's, at one
fixed commit that `main` resolves to. A test points huggingface_hub at it with `HF_ENDPOINT`
(`FakeHub.environ`).

It stands in for huggingface.co, which tests may not reach (and this machine cannot): every
request a test's download makes comes here, and is logged, so a test can say which files were
asked for and that a start asked for nothing; and it can fail on purpose (`drop`, `stop_after`,
`silent`).

What it answers, as the hub does (huggingface_hub's file_download.py and hf_api.py read these):

- `HEAD|GET /{repo}/resolve/{revision}/{path}`: a small file with 200, its git blob id as
  `ETag`, its `Content-Length` and the commit as `X-Repo-Commit`; a weights file (LFS on the
  hub) with a 302 to a CDN host (`localhost`, another host than the endpoint's `127.0.0.1`, so
  that the client reads the file's metadata from the redirect: `X-Linked-Etag` its sha256,
  `X-Linked-Size`, `X-Repo-Commit`); `GET /cdn/{sha256}/{path}` serves its bytes. A GET with
  `Range: bytes=N-` is a 206 from N (a resumed download).
- `GET /api/models/{repo}[/revision/{revision}]`: the repository's info, `sha` the commit.
- `GET /api/models/{repo}/tree/{revision}[/{path}]?recursive=..`: its files and folders as JSON,
  `page_size` entries a page, the next page named by a `Link: <..>; rel="next"` header.
- A repository, revision or file it lacks: 404 with the hub's `X-Error-Code` (RepoNotFound,
  RevisionNotFound, EntryNotFound).
"""

from __future__ import annotations

import hashlib
import json
import socket
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlencode, urlsplit

COMMIT = "3f1c0d2e9b8a7f6e5d4c3b2a1f0e9d8c7b6a5f4e"  # the one commit main names
# Files the hub keeps in LFS (weights and the like): served through the CDN's redirect.
LFS_SUFFIXES = (".safetensors", ".bin", ".onnx", ".onnx_data", ".msgpack", ".h5", ".ckpt", ".pt")
POINTER_SIZE = 134  # an LFS pointer file's size, as the tree names it


@dataclass(frozen=True, slots=True)
class Request:
    """One request the hub got: its method, what it asked for (`resolve` a file's metadata or
    content, `cdn` an LFS file's content, `tree` or `revision` of the API), the file (None for
    the API), its Range, and whether it was answered (False: dropped on purpose)."""

    method: str
    kind: str
    file: str | None
    range: str | None
    answered: bool

    @property
    def content(self) -> bool:
        """Whether it asked for a file's bytes (a GET of the file itself, not its metadata or a
        redirect to them)."""
        return self.method == "GET" and self.kind in ("resolve", "cdn")


@dataclass(frozen=True, slots=True)
class _File:
    data: bytes
    sha256: str
    git_oid: str


class FakeHub:
    """One repository (`repo_id`, the files under `folder`) at one commit, served on a free
    port of 127.0.0.1 from `start()` (or `with`) to `close()`."""

    def __init__(
        self, repo_id: str, folder: Path, *, commit: str = COMMIT, page_size: int = 4
    ) -> None:
        self.repo_id, self.commit, self.page_size = repo_id, commit, page_size
        self.files: dict[str, _File] = {}
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            data = path.read_bytes()
            self.files[path.relative_to(folder).as_posix()] = _File(
                data=data,
                sha256=hashlib.sha256(data).hexdigest(),
                git_oid=hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest(),
            )
        self.requests: list[Request] = []
        self._lock = threading.Lock()
        self._drop: dict[str, int] = {}  # file -> the byte after which its content is cut
        self._stop_after: str | None = None
        self._stopped = False
        self._silent: set[str] = set()  # kinds of request held unanswered until heal()
        self._released = threading.Event()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- serving ------------------------------------------------------------------------------

    def start(self) -> FakeHub:
        hub = self

        class Handler(_Handler):
            served = hub

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._released.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._server = self._thread = None

    def __enter__(self) -> FakeHub:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def port(self) -> int:
        assert self._server is not None, "the fake hub is not started"
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        """The endpoint (HF_ENDPOINT)."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def cdn(self) -> str:
        """Where LFS files are served from: the same server under another host name, which
        huggingface_hub takes for a CDN (it reads the metadata off the redirect)."""
        return f"http://localhost:{self.port}"

    def environ(self, home: Path, **more: str) -> dict[str, str]:
        """The variables that point huggingface_hub at this hub, with `home` as HF_HOME (its
        cache `home/hub`, no token), and never offline."""
        return {
            "HF_ENDPOINT": self.url,
            "HF_HOME": str(home),
            "HF_HUB_OFFLINE": "0",
            "HF_HUB_DISABLE_TELEMETRY": "1",
            "HF_HUB_DISABLE_IMPLICIT_TOKEN": "1",
            "NO_PROXY": "127.0.0.1,localhost",
            "no_proxy": "127.0.0.1,localhost",
            **more,
        }

    # -- failing on purpose -------------------------------------------------------------------

    def drop(self, file: str, *, after: int | None = None) -> None:
        """Cut the connection of every GET of `file`'s bytes once `after` bytes of the file (half
        of it by default) have been sent: the first GET gets that much, a resumed one from
        there on gets none. Until `heal()`."""
        size = len(self.files[file].data)
        with self._lock:
            self._drop[file] = size // 2 if after is None else after

    def stop_after(self, file: str) -> None:
        """Once `file`'s bytes have been served, answer nothing more: every later request's
        connection is closed without a response. Until `heal()`."""
        with self._lock:
            self._stop_after, self._stopped = file, False

    def silent(self, kind: str) -> None:
        """Accept every request of `kind` ("tree": the file list's pages) and answer nothing,
        the connection held open, until `heal()` or `close()` (a hub behind a proxy that
        stalls): no client timeout of its own ends it, the caller's bound must."""
        with self._lock:
            self._silent.add(kind)
            self._released.clear()

    def heal(self) -> None:
        """Answer every request again."""
        with self._lock:
            self._drop.clear()
            self._stop_after, self._stopped = None, False
            self._silent.clear()
        self._released.set()

    # -- what was asked -----------------------------------------------------------------------

    def forget(self) -> None:
        """Start the log afresh (between two starts)."""
        with self._lock:
            self.requests.clear()

    def log(self) -> list[Request]:
        with self._lock:
            return list(self.requests)

    def requested(self) -> set[str]:
        """Every file asked about at all (its metadata or its bytes)."""
        return {r.file for r in self.log() if r.file is not None}

    def downloads(self) -> Counter[str]:
        """How many times each file's bytes were asked for."""
        return Counter(r.file for r in self.log() if r.content and r.file is not None)

    def _record(self, request: Request) -> None:
        with self._lock:
            self.requests.append(request)

    def _answering(self) -> bool:
        with self._lock:
            return not self._stopped

    def _holds(self, kind: str) -> bool:
        with self._lock:
            return kind in self._silent

    def _served(self, file: str) -> None:
        with self._lock:
            if self._stop_after == file:
                self._stopped = True

    def _cut_at(self, file: str) -> int | None:
        with self._lock:
            return self._drop.get(file)

    # -- the API's documents ------------------------------------------------------------------

    def is_lfs(self, file: str) -> bool:
        return file.endswith(LFS_SUFFIXES)

    def tree(self, under: str, *, recursive: bool) -> list[dict[str, Any]]:
        """The tree's entries under `under` ("" the root), folders and files, as the hub lists
        them."""
        prefix = f"{under.strip('/')}/" if under.strip("/") else ""
        folders: set[str] = set()
        entries: list[dict[str, Any]] = []
        for path, file in self.files.items():
            if not path.startswith(prefix):
                continue
            rest = path[len(prefix) :].split("/")
            for depth in range(1, len(rest)):
                if depth > 1 and not recursive:
                    break
                folders.add(prefix + "/".join(rest[:depth]))
            if len(rest) > 1 and not recursive:
                continue
            entry: dict[str, Any] = {
                "type": "file", "oid": file.git_oid, "size": len(file.data), "path": path,
            }  # fmt: skip
            if self.is_lfs(path):
                entry["lfs"] = {
                    "oid": file.sha256, "size": len(file.data), "pointerSize": POINTER_SIZE,
                }  # fmt: skip
            entries.append(entry)
        for folder in folders:
            oid = hashlib.sha1(folder.encode()).hexdigest()
            entries.append({"type": "directory", "oid": oid, "size": 0, "path": folder})
        return sorted(entries, key=lambda e: e["path"])

    def info(self) -> dict[str, Any]:
        """`/api/models/{repo}/revision/{revision}`'s document."""
        return {
            "_id": hashlib.sha1(self.repo_id.encode()).hexdigest()[:24],
            "id": self.repo_id,
            "modelId": self.repo_id,
            "sha": self.commit,
            "private": False,
            "disabled": False,
            "gated": False,
            "downloads": 0,
            "likes": 0,
            "tags": ["diffusers"],
            "library_name": "diffusers",
            "lastModified": "2025-01-01T00:00:00.000Z",
            "createdAt": "2025-01-01T00:00:00.000Z",
            "siblings": [{"rfilename": path} for path in self.files],
        }


class _Handler(BaseHTTPRequestHandler):
    served: FakeHub
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass  # quiet: the hub's log is `requests`

    def do_HEAD(self) -> None:
        self._route("HEAD")

    def do_GET(self) -> None:
        self._route("GET")

    # -- routing ------------------------------------------------------------------------------

    def _route(self, method: str) -> None:
        hub = self.served
        parts = urlsplit(self.path)
        path = unquote(parts.path)
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        kind, file, revision, repo = self._parse(path)
        wanted = self.headers.get("Range")
        if not hub._answering():
            hub._record(Request(method, kind, file, wanted, answered=False))
            self._hang_up()
            return
        if hub._holds(kind):
            hub._record(Request(method, kind, file, wanted, answered=False))
            hub._released.wait()
            self._hang_up()
            return
        hub._record(Request(method, kind, file, wanted, answered=True))
        if kind == "unknown":
            self._error(404, "NotFound", f"no route {path}")
        elif repo != hub.repo_id and kind != "cdn":
            self._error(404, "RepoNotFound", f"Repository {repo} not found")
        elif kind != "cdn" and revision not in ("main", hub.commit):
            self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        elif kind == "revision":
            self._json(hub.info())
        elif kind == "tree":
            self._tree(file or "", query)
        elif file is None or file not in hub.files:
            self._error(404, "EntryNotFound", f"{file} does not exist on {revision}")
        elif kind == "cdn":
            self._content(method, file)
        elif hub.is_lfs(file):
            self._redirect_to_cdn(file)
        else:
            self._content(method, file, etag=hub.files[file].git_oid)

    def _parse(self, path: str) -> tuple[str, str | None, str | None, str | None]:
        """(kind, file, revision, repo) of a request's path."""
        bits = path.lstrip("/").split("/")
        if bits[:1] == ["cdn"] and len(bits) >= 3:
            return "cdn", "/".join(bits[2:]), None, None
        if bits[:2] == ["api", "models"] and len(bits) == 4:  # model_info without a revision
            return "revision", None, "main", "/".join(bits[2:4])
        if bits[:2] == ["api", "models"] and len(bits) >= 6 and bits[4] in ("revision", "tree"):
            repo, kind, revision = "/".join(bits[2:4]), bits[4], bits[5]
            return kind, "/".join(bits[6:]) or None, revision, repo
        if len(bits) >= 5 and bits[2] == "resolve":
            return "resolve", "/".join(bits[4:]), bits[3], "/".join(bits[:2])
        return "unknown", None, None, None

    # -- answers ------------------------------------------------------------------------------

    def _common(self) -> None:
        self.send_header("X-Repo-Commit", self.served.commit)
        self.send_header("Accept-Ranges", "bytes")

    def _error(self, status: int, code: str, message: str) -> None:
        body = json.dumps({"error": message}).encode()
        self.send_response(status)
        self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        if code == "EntryNotFound":
            self.send_header("X-Repo-Commit", self.served.commit)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, doc: Any, *, link: str | None = None) -> None:
        body = json.dumps(doc).encode()
        self.send_response(200)
        self._common()
        if link is not None:
            self.send_header("Link", f'<{link}>; rel="next"')
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _tree(self, under: str, query: dict[str, str]) -> None:
        hub = self.served
        recursive = query.get("recursive", "false").lower() == "true"
        entries = hub.tree(under, recursive=recursive)
        start = int(query.get("cursor", "0"))
        page = entries[start : start + hub.page_size]
        link = None
        if start + hub.page_size < len(entries):
            path = urlsplit(self.path).path
            params = urlencode({**query, "cursor": str(start + hub.page_size)})
            link = f"{hub.url}{path}?{params}"
        self._json(page, link=link)

    def _redirect_to_cdn(self, file: str) -> None:
        hub, found = self.served, self.served.files[file]
        self.send_response(302)
        self._common()
        self.send_header("Location", f"{hub.cdn}/cdn/{found.sha256}/{quote(file)}")
        self.send_header("ETag", f'"{found.git_oid}"')
        self.send_header("X-Linked-Etag", f'"{found.sha256}"')
        self.send_header("X-Linked-Size", str(len(found.data)))
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _content(self, method: str, file: str, *, etag: str | None = None) -> None:
        hub = self.served
        data = hub.files[file].data
        start = 0
        wanted = self.headers.get("Range", "")
        if wanted.startswith("bytes=") and wanted[6:].endswith("-"):
            start = min(int(wanted[6:-1]), len(data))
        self.send_response(206 if start else 200)
        self._common()
        self.send_header("ETag", f'"{etag or hub.files[file].sha256}"')
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(data) - start))
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.end_headers()
        if method == "HEAD":
            return
        cut = hub._cut_at(file)
        if cut is not None:
            self.wfile.write(data[start : max(start, cut)])
            self._hang_up()
            return
        self.wfile.write(data[start:])
        self.wfile.flush()
        hub._served(file)

    def _hang_up(self) -> None:
        """Close the connection at once, whatever was (not) sent."""
        self.close_connection = True
        try:
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


@contextmanager
def fake_hub(repo_id: str, folder: Path, **kwargs: Any) -> Iterator[FakeHub]:
    """A started FakeHub, closed at the end."""
    hub = FakeHub(repo_id, folder, **kwargs)
    with hub:
        yield hub
