"""A local HTTP server that speaks the Hugging Face Hub's file-download API, for tests.

Routes (what huggingface_hub's ``hf_hub_download`` uses):

- ``HEAD|GET /{org}/{repo}/resolve/{revision}/{path}`` -> 200 with ``X-Repo-Commit``, ``ETag`` (as the Hub's: the
  sha256 of the bytes for a file stored in LFS, by its suffix; for any other, its git blob id, the sha1 of
  ``b"blob <size>\0"`` and the bytes), ``Content-Length`` (GET: the bytes, ``Range`` honoured); 404 with ``X-Error-Code`` ``RepoNotFound``,
  ``RevisionNotFound`` or ``EntryNotFound`` (the last with ``X-Repo-Commit``, as the Hub does).
- ``GET /api/models/{org}/{repo}/revision/{revision}`` -> ``{"id", "sha", "siblings"}``
  (``GET /api/models/{org}/{repo}``: the same for ``main``).

Every request is logged in ``requests``; ``drop_once[path] = [n1, n2, ...]`` makes the next GETs of
that file send ``n1``, ``n2``, ... bytes and then cut the connection (interrupted downloads);
``busy[path] = n`` answers the next ``n`` requests for that file with 503 (a Hub that asks for a retry);
``gates["org/repo/path"] = event`` sends the headers of every GET of that repo's file, then its bytes only once
``event`` is set (a slow download); ``slow_headers[path] = (method, every, stop)`` answers that method for the file
with its status line, then its headers a byte every ``every`` seconds, never ending them, until ``stop`` is set (a
Hub that trickles its headers); ``lies[path] = {"etag": ..., "commit": ..., "size": n, "body": bytes}`` makes
the file's answers (its 404 too) carry that ETag or X-Repo-Commit, announce ``size`` bytes (-1: no size) and send ``body`` (a
hostile Hub or mirror).
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote


# Suffixes the Hub's default .gitattributes stores in LFS (the others are plain git files).
LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".onnx", ".gguf", ".npy", ".npz",
                ".pkl", ".pickle", ".zip", ".gz", ".tar")


def hub_etag(path: str, data: bytes) -> str:
    """The ETag the Hub answers for ``path`` holding ``data``: the sha256 for an LFS file, else the git blob id."""
    if path.endswith(LFS_SUFFIXES):
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Repo:
    refs: dict[str, str] = field(default_factory=dict)  # branch/tag -> commit
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)  # commit -> {path: bytes}

    def commit(self, files: dict[str, bytes], *, branch: str = "main", parent: str | None = None,
               tags: tuple[str, ...] = ()) -> str:
        base = dict(self.commits[parent]) if parent else (dict(self.commits[self.refs[branch]]) if branch in self.refs else {})
        base.update(files)
        sha = hashlib.sha1(json.dumps(sorted((k, hashlib.sha256(v).hexdigest()) for k, v in base.items())).encode()
                           + str(len(self.commits)).encode()).hexdigest()
        self.commits[sha] = base
        self.refs[branch] = sha
        for t in tags:
            self.refs[t] = sha
        return sha


class HubServer:
    """The server; ``repos[repo_id]`` holds the content. Start with ``start()``, stop with ``stop()``."""

    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.requests: list[tuple[str, str]] = []
        self.drop_once: dict[str, list[int]] = {}
        self.busy: dict[str, int] = {}
        self.gates: dict[str, threading.Event] = {}
        self.slow_headers: dict[str, tuple[str, float, threading.Event]] = {}
        self.lies: dict[str, dict[str, object]] = {}  # per file; "from": k lies from its k-th request on (1-based)
        self.seen: dict[str, int] = {}  # requests per file name
        # attack harness: script[filename](nth, command, status, headers, body) -> (status, headers, body) rewrites
        # a file's answer (headers: list of (name, value)); routes[path](command, headers) -> (status, headers, body)
        # answers any other path (a CDN, a renamed repo), its body bytes or an iterable of bytes sent as it yields
        self.script: dict[str, object] = {}
        self.routes: dict[str, object] = {}
        self.lock = threading.Lock()
        self._httpd: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        assert self._httpd is not None
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def repo(self, repo_id: str) -> Repo:
        return self.repos.setdefault(repo_id, Repo())

    def count(self) -> int:
        with self.lock:
            return len(self.requests)

    def start(self) -> HubServer:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:  # quiet
                pass

            def do_HEAD(self) -> None:
                self._serve(head=True)

            def do_GET(self) -> None:
                self._serve(head=False)

            def _error(self, code: int, error_code: str, commit: str | None = None) -> None:
                body = json.dumps({"error": error_code}).encode()
                self.send_response(code)
                self.send_header("X-Error-Code", error_code)
                self.send_header("X-Error-Message", error_code)
                if commit:
                    self.send_header("X-Repo-Commit", commit)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def _serve(self, head: bool) -> None:
                path = self.path.split("?", 1)[0]
                with server.lock:
                    server.requests.append((self.command, path))
                route = server.routes.get(path) or next(
                    (r for k, r in list(server.routes.items()) if k.endswith("*") and path.startswith(k[:-1])), None)
                if route is not None:
                    status, hdrs, body = route(self.command, dict(self.headers))  # type: ignore[operator]
                    return self._send(status, hdrs, body, head)
                parts = path.strip("/").split("/")
                if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] == "revision":
                    return self._api_revision(parts[2] + "/" + parts[3], unquote("/".join(parts[5:])))
                if parts[:2] == ["api", "models"] and len(parts) == 4:  # no revision: the default branch
                    return self._api_revision(parts[2] + "/" + parts[3], "main")
                if len(parts) < 5 or parts[2] != "resolve":
                    return self._error(404, "RepoNotFound")
                repo_id = parts[0] + "/" + parts[1]
                revision = unquote(parts[3])
                filename = unquote("/".join(parts[4:]))
                with server.lock:
                    busy = server.busy.get(filename, 0)
                    if busy:
                        server.busy[filename] = busy - 1
                if busy:
                    return self._error(503, "ServiceUnavailable")
                found = self._find_commit(repo_id, revision)
                if found is None:
                    return
                repo, commit = found
                data = repo.commits[commit].get(filename)
                with server.lock:
                    nth = server.seen[filename] = server.seen.get(filename, 0) + 1
                lie = server.lies.get(filename, {})
                if nth < int(lie.get("from", 1)):  # type: ignore[call-overload]
                    lie = {}
                commit = str(lie.get("commit", commit))
                if data is None:
                    return self._error(404, "EntryNotFound", commit)
                etag = str(lie.get("etag", hub_etag(filename, data)))
                if "body" in lie and not head:
                    data = bytes(lie["body"])  # type: ignore[arg-type]
                elif "size" in lie and head and int(lie["size"]) >= 0:  # type: ignore[call-overload]
                    data = b"\0" * int(lie["size"])  # type: ignore[call-overload]
                start, end = 0, len(data)
                rng = self.headers.get("Range")
                status = 200
                if rng and rng.startswith("bytes="):
                    a, _, b = rng[6:].partition("-")
                    start = int(a or 0)
                    end = int(b) + 1 if b else len(data)
                    status = 206
                hdrs: list[tuple[str, str]] = [("X-Repo-Commit", commit), ("ETag", '"' + etag + '"')]
                if lie.get("xet"):  # the headers of a file in Xet storage
                    hdrs.append(("X-Xet-Hash", "0" * 64))
                    hdrs.append(("X-Xet-Refresh-Route", f"/api/models/{repo_id}/xet-read-token/{commit}"))
                if not (head and lie.get("size") == -1):  # -1: a HEAD that tells no size
                    hdrs.append(("Content-Length", str(end - start)))
                if status == 206:
                    hdrs.append(("Content-Range", f"bytes {start}-{end - 1}/{len(data)}"))
                hdrs.append(("Content-Type", "application/octet-stream"))
                payload = data[start:end]
                script = server.script.get(filename)
                if script is not None:
                    status, hdrs, payload = script(nth, self.command, status, hdrs, payload)  # type: ignore[operator]
                    data = payload
                    start, end = 0, len(payload)
                slow = server.slow_headers.get(filename)
                if slow is not None and slow[0] == self.command:
                    return self._trickle_headers(status, hdrs, slow[1], slow[2])
                self.send_response(status)
                for k, v in hdrs:
                    self.send_header(k, v)
                self.end_headers()
                if head:
                    return
                gate = server.gates.get(f"{repo_id}/{filename}")
                if gate is not None:
                    self.wfile.flush()
                    gate.wait(60)
                with server.lock:
                    cuts = server.drop_once.get(filename)
                    cut = cuts.pop(0) if cuts else None
                payload = data[start:end]
                if cut is not None:
                    self.wfile.write(payload[:cut])
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                self.wfile.write(payload)

            def _trickle_headers(self, status: int, hdrs: list[tuple[str, str]], every: float,
                                 stop: threading.Event) -> None:
                """The status line and ``hdrs`` at once, then a header a byte every ``every`` seconds, never ended."""
                self.close_connection = True
                lines = [f"HTTP/1.1 {status} OK\r\n", *(f"{k}: {v}\r\n" for k, v in hdrs), "X-Padding: "]
                try:
                    self.wfile.write("".join(lines).encode())
                    self.wfile.flush()
                    while not stop.wait(every):
                        self.wfile.write(b"a")
                        self.wfile.flush()
                except OSError:  # the client gave up
                    return

            def _send(self, status: int, hdrs: list[tuple[str, str]], body: bytes, head: bool) -> None:
                self.send_response(status)
                for k, v in hdrs:
                    self.send_header(k, v)
                if not isinstance(body, bytes):  # streamed, maybe with no length: its end is the connection's
                    self.send_header("Connection", "close")
                    self.close_connection = True
                self.end_headers()
                if head or not body:
                    return
                for chunk in [body] if isinstance(body, bytes) else body:  # a route may stream (an iterable of bytes)
                    try:
                        self.wfile.write(chunk)
                        self.wfile.flush()
                    except OSError:  # the client stopped reading
                        return

            def _find_commit(self, repo_id: str, revision: str) -> tuple[Repo, str] | None:
                """The repo and the commit ``revision`` names there, or None once the 401 or 404 is sent."""
                repo = server.repos.get(repo_id)
                if repo is None:
                    self._error(401, "RepoNotFound")
                    return None
                commit = repo.refs.get(revision, revision if revision in repo.commits else None)
                if commit is None:
                    self._error(404, "RevisionNotFound")
                    return None
                return repo, commit

            def _api_revision(self, repo_id: str, revision: str) -> None:
                found = self._find_commit(repo_id, revision)
                if found is None:
                    return
                repo, commit = found
                body = json.dumps({"id": repo_id, "sha": commit,
                                   "siblings": [{"rfilename": f} for f in sorted(repo.commits[commit])]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        threading.Thread(target=self._httpd.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()


SERVER: HubServer | None = None  # the running server, set by the root conftest
