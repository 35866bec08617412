"""A real HTTP server standing in for an OpenAI-compatible engine (vLLM's server) in unit tests: it lists one
model and answers JSON; each test's subclass answers the completions (`do_POST`)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class OpenAIStandIn(BaseHTTPRequestHandler):
    """Lists `model_id` at `/v1/models`; `reply` sends a JSON answer, `request_body` reads the request's."""

    model_id = "stand-in"

    def log_message(self, *args):
        pass

    def request_body(self) -> dict[str, Any]:
        return json.loads(self.rfile.read(int(self.headers["content-length"])))

    def reply(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self.reply(200, {"data": [{"id": self.model_id}]})


@contextmanager
def serving(handler: type[OpenAIStandIn]) -> Iterator[str]:
    """Serve `handler` on a free local port, one thread per request; yields the base URL, stops on exit."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
