"""A local HTTP stand-in of the Hugging Face Hub's write API, as much of it as `HfApi.create_repo` and
`HfApi.upload_folder` use for small files: repo creation, the pre-upload check (every file answered
`regular`, so contents travel inline in the commit) and the NDJSON commit. It keeps what was committed and the
headers each request came with, so a test checks what `huggingface_hub` really sent."""

from __future__ import annotations

import base64
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class HubRecord:
    """What the fake Hub received: repos created, files committed per repo, and every request's headers."""

    repos: list[dict[str, Any]] = field(default_factory=list)
    files: dict[str, dict[str, bytes]] = field(default_factory=dict)
    commits: list[dict[str, Any]] = field(default_factory=list)
    authorizations: list[str] = field(default_factory=list)
    validated: list[str] = field(default_factory=list)


def validate_front_matter(content: str) -> tuple[int, dict[str, Any]]:
    """The Hub's answer to a README: 400 with the error where its front matter is not a YAML mapping."""
    import yaml

    if not content.startswith("---\n") or "\n---\n" not in content:
        return 200, {"errors": [], "warnings": [{"message": "empty or missing yaml metadata in repo card"}]}
    try:
        metadata = yaml.safe_load(content[4 : content.index("\n---\n", 4)])
    except yaml.YAMLError as exc:
        return 400, {"errors": [{"message": str(exc)}]}
    if not isinstance(metadata, dict):
        return 400, {"errors": [{"message": "metadata is not a mapping"}]}
    return 200, {"errors": [], "warnings": []}


def handler(record: HubRecord, base_url: str) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            """Quiet: the test reads `record`."""

        def reply(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self) -> None:
            record.authorizations.append(self.headers.get("Authorization", ""))
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            parts = self.path.split("?")[0].strip("/").split("/")
            if parts[:3] == ["api", "repos", "create"]:
                request = json.loads(body)
                record.repos.append(request)
                name = (
                    f"{request.get('organization')}/{request['name']}"
                    if request.get("organization")
                    else request["name"]
                )
                return self.reply(200, {"url": f"{base_url}/{name}", "name": name})
            if parts == ["api", "validate-yaml"]:  # the README's front matter, checked before anything uploads
                content = json.loads(body)["content"]
                record.validated.append(content)
                return self.reply(*validate_front_matter(content))
            if parts[:2] == ["api", "models"] and parts[4] == "preupload":
                files = json.loads(body)["files"]
                return self.reply(200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                                  for f in files]})  # fmt: skip
            if parts[:2] == ["api", "models"] and parts[4] == "commit":
                repo = f"{parts[2]}/{parts[3]}"
                lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
                record.commits.append({"repo": repo, "header": lines[0]["value"]})
                for line in lines[1:]:
                    if line["key"] == "file":
                        content = base64.b64decode(line["value"]["content"])
                        record.files.setdefault(repo, {})[line["value"]["path"]] = content
                oid = f"{len(record.commits):040x}"
                return self.reply(200, {"commitUrl": f"{base_url}/{repo}/commit/{oid}", "commitOid": oid})
            return self.reply(404, {"error": f"fake hub: no {self.path}"})

    return Handler


class FakeHub:
    """`with FakeHub() as hub:` serves on a free loopback port at `hub.url`; `hub.record` is what it got."""

    def __init__(self) -> None:
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.record = HubRecord()
        self.server.RequestHandlerClass = handler(self.record, self.url)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
