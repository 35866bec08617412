"""A forwarding HTTP proxy in front of a real engine that holds one chat completion: the `held`-th
POST to /v1/chat/completions waits until the test releases it, then goes on to the engine. Everything
else passes straight through. A test that kills a client mid-conversation points the client here, waits
for `asked` (the client has logged every earlier turn and asked the next) and kills it then, whatever the
machine's load: a kill timed by polling a file can come too late on a busy host."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

CHAT_PATH = "/v1/chat/completions"
# Response headers the proxy sets itself (or that no longer hold once httpx decoded the body).
HOP_HEADERS = {"connection", "content-length", "content-encoding", "transfer-encoding", "keep-alive", "date", "server"}


class HeldRequest:
    """The proxy's state: how many chat completions it saw, `asked` once the held one arrived, `release`
    to let it through."""

    def __init__(self, engine_url: str, held: int):
        self.engine_url = engine_url
        self.held = held
        self.chats = 0
        self.lock = threading.Lock()
        self.asked = threading.Event()
        self.release = threading.Event()
        self.base_url = ""

    def count_chat(self, path: str) -> bool:
        """Count a request; True if it is the one to hold."""
        if path != CHAT_PATH:
            return False
        with self.lock:
            self.chats += 1
            return self.chats == self.held


def handler_for(state: HeldRequest) -> type[BaseHTTPRequestHandler]:
    class Forward(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:
            return

        def forward(self, method: str) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0) or 0))
            if state.count_chat(self.path):
                state.asked.set()
                state.release.wait()
            headers = {"Content-Type": self.headers.get("Content-Type", "application/json")}
            if auth := self.headers.get("Authorization"):
                headers["Authorization"] = auth
            answer = httpx.request(method, state.engine_url + self.path, content=body, headers=headers, timeout=600)
            try:
                self.send_response(answer.status_code)
                for name, value in answer.headers.items():
                    if name.lower() not in HOP_HEADERS:
                        self.send_header(name, value)
                self.send_header("Content-Length", str(len(answer.content)))
                self.end_headers()
                self.wfile.write(answer.content)
            except (BrokenPipeError, ConnectionResetError):
                return  # the client was killed while its request was held

        def do_GET(self) -> None:
            self.forward("GET")

        def do_POST(self) -> None:
            self.forward("POST")

    return Forward


@contextmanager
def holding_chat(engine_url: str, held: int) -> Iterator[HeldRequest]:
    """A proxy on a free local port in front of `engine_url`, holding its `held`-th chat completion; its
    `base_url` is where to point the client. On exit the held request is released and the proxy stopped."""
    state = HeldRequest(engine_url, held)
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler_for(state))
    server.daemon_threads = True
    state.base_url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        state.release.set()
        server.shutdown()
        server.server_close()
