"""A real HTTP server standing in for the Hugging Face Hub (what `HF_ENDPOINT` points huggingface_hub at), so
unit tests run its real client offline: model info by revision, the file tree, and file downloads with the
headers huggingface_hub reads (X-Repo-Commit, ETag, Content-Length) and `Range` for resumed downloads; a file
named in `cut_once` has its first download cut one byte short (the connection closed mid-body). A repo may be
gated (its files refused without an account that accepted its terms); unknown repos and revisions get the Hub's
error codes. Every request's path, Range and Authorization header is recorded."""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

INFO = re.compile(r"/api/models/(?P<repo>[^/]+/[^/]+)/revision/(?P<revision>[^/?]+)")
TREE = re.compile(r"/api/models/(?P<repo>[^/]+/[^/]+)/tree/(?P<revision>[^/?]+)")
RESOLVE = re.compile(r"/(?P<repo>[^/]+/[^/]+)/resolve/(?P<revision>[^/]+)/(?P<file>[^?]+)")


@dataclass
class HubRepo:
    """A repo of the stand-in: its files (a folder's), the commit `main` names, and whether it is gated."""

    folder: Path
    commit: str
    gated: bool = False

    def files(self) -> dict[str, bytes]:
        return {p.name: p.read_bytes() for p in sorted(self.folder.iterdir()) if p.is_file()}


@dataclass
class HubStandIn:
    """The repos served and the requests seen: (method, path, Range header, Authorization header)."""

    repos: dict[str, HubRepo]
    cut_once: set[str] = field(default_factory=set)
    requests: list[tuple[str, str, str | None, str | None]] = field(default_factory=list)


def handler_for(hub: HubStandIn) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def send(self, code: int, body: bytes = b"", headers: dict[str, str] | None = None, head: bool = False):
            self.send_response(code)
            for name, value in {"Content-Length": str(len(body)), **(headers or {})}.items():
                self.send_header(name, value)
            self.end_headers()
            if not head:
                self.wfile.write(body)

        def error(self, code: int, error_code: str, message: str, head: bool = False) -> None:
            body = json.dumps({"error": message}).encode()
            self.send(code, body, {"X-Error-Code": error_code, "X-Error-Message": message}, head)

        def repo(self, match: re.Match, head: bool = False) -> HubRepo | None:
            """The repo at its revision (`main` or its commit); None after answering the Hub's error."""
            repo = hub.repos.get(match["repo"])
            if repo is None:
                self.error(404, "RepoNotFound", "Repository not found", head)
            elif match["revision"] not in ("main", repo.commit):
                self.error(404, "RevisionNotFound", f"Invalid rev id: {match['revision']}", head)
            return repo if repo is not None and match["revision"] in ("main", repo.commit) else None

        def answer(self, head: bool) -> None:
            path = self.path.split("?")[0]
            hub.requests.append((self.command, path, self.headers.get("Range"), self.headers.get("Authorization")))
            if (match := INFO.fullmatch(path)) and (repo := self.repo(match)):
                siblings = [{"rfilename": name} for name in repo.files()]
                info = {"id": match["repo"], "sha": repo.commit, "siblings": siblings, "gated": repo.gated}
                self.send(200, json.dumps(info).encode(), {"Content-Type": "application/json"})
            elif (match := TREE.fullmatch(path)) and (repo := self.repo(match)):
                tree = [{"type": "file", "path": n, "size": len(d), "oid": hashlib.sha1(d).hexdigest()}
                        for n, d in repo.files().items()]  # fmt: skip
                self.send(200, json.dumps(tree).encode(), {"Content-Type": "application/json"})
            elif (match := RESOLVE.fullmatch(path)) and (repo := self.repo(match, head)):
                if repo.gated:
                    self.error(
                        403 if self.headers.get("Authorization") else 401, "GatedRepo", "Access restricted", head
                    )
                    return
                self.send_file(repo, match["file"], head)
            elif not (INFO.fullmatch(path) or TREE.fullmatch(path) or RESOLVE.fullmatch(path)):
                self.error(404, "EntryNotFound", "not found", head)

        def send_file(self, repo: HubRepo, name: str, head: bool) -> None:
            data = repo.files().get(name)
            if data is None:
                self.error(404, "EntryNotFound", f"{name} not found", head)
                return
            headers = {"ETag": f'"{hashlib.sha256(data).hexdigest()}"', "X-Repo-Commit": repo.commit}
            start = int(m[1]) if (m := re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range") or "")) else 0
            if start:
                headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
            if not head and name in hub.cut_once:
                hub.cut_once.discard(name)
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data[:-1])
                self.close_connection = True
                return
            self.send(206 if start else 200, data[start:], headers, head)

        def do_GET(self):
            self.answer(head=False)

        def do_HEAD(self):
            self.answer(head=True)

    return Handler


@contextmanager
def hub_standin(repos: dict[str, HubRepo], cut_once: set[str] | None = None) -> Iterator[tuple[str, HubStandIn]]:
    """Serve `repos` on a free local port; yields (endpoint URL, the stand-in), stops on exit."""
    hub = HubStandIn(repos, set(cut_once or ()))
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler_for(hub))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", hub
    finally:
        httpd.shutdown()
