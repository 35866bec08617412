"""The vLLM extraction backend when its engine dies, against a real HTTP server standing in for a vLLM
whose engine core died (every completion answered 500, as vLLM does until it exits): the shard fails with
`EngineDied` (retried) when the engine's process is gone, and with the server's answer (a bad shard, not
retried) while it still runs."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from eagle3_core.extraction.vllm_backend import ServerAnswerError, VllmBackend
from eagle3_core.serving.engine import EngineDied
from tasks.policy import is_deterministic

ROWS = [{"id": f"s{i}", "input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]} for i in range(4)]


class DeadCore(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def reply(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self.reply(200, {"data": [{"id": "target"}]})

    def do_POST(self):
        self.rfile.read(int(self.headers["content-length"]))
        self.reply(500, {"error": "EngineDeadError: EngineCore encountered an issue"})


@pytest.fixture
def dead_core_url():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), DeadCore)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def test_a_shard_fails_with_engine_died_once_the_engine_is_gone(dead_core_url):
    waits: list[float] = []

    def exited(wait_s: float) -> str:
        waits.append(wait_s)
        return "vLLM server pid 9 (extraction) died: exit code 1; log server/extraction.log"

    backend = VllmBackend(dead_core_url, None, 2, 10, exited)
    try:
        with pytest.raises(EngineDied, match="died: exit code 1") as info:
            backend.extract(ROWS)
    finally:
        backend.close()
    assert waits and waits[0] > 0, "a 5xx waits for the dying engine to exit"
    assert not is_deterministic(info.value), "retried, though the cause chain holds a bad-shard error"


def test_a_5xx_from_a_running_engine_stays_the_shards_failure(dead_core_url):
    backend = VllmBackend(dead_core_url, None, 2, 10, lambda wait_s: None)
    try:
        with pytest.raises(ServerAnswerError, match="server answered 500") as info:
            backend.extract(ROWS)
    finally:
        backend.close()
    assert is_deterministic(info.value)
