"""The vLLM extraction backend against a real HTTP server standing in for vLLM.

- An engine that answers each prefill with a connector file and its lock, as vLLM's connector leaves them: the
  next shards' requests are in flight while a shard's last request is still answered, the shards come back in
  order with their own states, and a failed shard stops the requests queued behind it.
- A vLLM whose engine core died (every completion answered 500, as vLLM does until it exits): the shard fails
  with `EngineDied` (retried) when the engine's process is gone, and with the server's answer (a bad shard, not
  retried) while it still runs.
"""

from __future__ import annotations

import threading
from contextlib import ExitStack
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from eagle3_core.extraction.connector import STATES
from eagle3_core.extraction.vllm_backend import ServerAnswerError, StatesFileError, VllmBackend, submitted_ahead
from eagle3_core.serving.engine import EngineDied
from tasks.policy import is_deterministic
from tests.helpers.openai_standin import OpenAIStandIn, serving

HIDDEN = 8
WAIT_S = 5.0
ROWS = [{"id": f"s{i}", "input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]} for i in range(4)]


def rows_of(count: int) -> list[dict]:
    """Samples whose first token names them: sample i starts with token i + 1."""
    return [{"id": f"s{i}", "input_ids": [i + 1, 7, 7], "loss_mask": [0, 1, 1]} for i in range(count)]


class ConnectorEngine(OpenAIStandIn):
    """Answers a completion after `hold(first_token)` returns; a first token in `refused` gets a 400, one in
    `lost` an answer whose file was never written (only its lock, as a worker killed mid-write leaves it)."""

    model_id = "target"
    storage: Path
    arrivals: list[int]
    hold: staticmethod
    refused: frozenset[int] = frozenset()
    lost: frozenset[int] = frozenset()

    def do_POST(self):
        ids = self.request_body()["prompt"]
        self.arrivals.append(ids[0])
        type(self).hold(ids[0])
        if ids[0] in self.refused:
            self.reply(400, {"error": "prompt too long"})
            return
        path = self.storage / f"{ids[0]}.safetensors"
        states = torch.full((len(ids), 4, HIDDEN), float(ids[0]), dtype=torch.bfloat16)  # [T, 4, H]
        if ids[0] not in self.lost:
            save_file({STATES: states, "token_ids": torch.tensor(ids)}, str(path))
        Path(f"{path}.lock").touch()
        body = {"choices": [{"prompt_token_ids": ids}], "kv_transfer_params": {"hidden_states_path": str(path)}}
        self.reply(200, body)


class DeadCore(OpenAIStandIn):
    model_id = "target"

    def do_POST(self):
        self.request_body()
        self.reply(500, {"error": "EngineDeadError: EngineCore encountered an issue"})


@pytest.fixture
def engine(tmp_path):
    with ExitStack() as servers:

        def start(hold, refused=frozenset(), lost=frozenset()) -> tuple[str, type[ConnectorEngine]]:
            fields = {"storage": tmp_path, "arrivals": [], "refused": refused, "lost": lost}
            handler = type("Engine", (ConnectorEngine,), fields)
            handler.hold = staticmethod(hold)
            return servers.enter_context(serving(handler)), handler

        yield start


@pytest.fixture
def dead_core_url():
    with serving(DeadCore) as url:
        yield url


def test_shards_are_handed_out_once_enough_later_rows_are_submitted():
    log: list[str] = []
    shards = [rows_of(2), rows_of(2), rows_of(2), rows_of(2), rows_of(1)]

    def submit(rows: list[dict]) -> int:
        log.append(f"submit {len(log) - log.count('out')}")
        return len(log)

    handed = submitted_ahead(shards, submit, rows_ahead=3)
    for rows, _ in handed:
        log.append("out")
        assert rows is shards[log.count("out") - 1], "shards come out in order"
    assert [entry.split()[0] for entry in log] == [
        "submit", "submit", "submit", "out", "submit", "out", "submit", "out", "out", "out",
    ]  # fmt: skip


def test_the_next_shard_is_in_flight_while_a_shards_last_request_is_answered(engine):
    next_shard_arrived = threading.Event()
    waited_out: list[bool] = []

    def hold(first_token: int) -> None:
        if first_token in (3, 4):  # shard 1
            next_shard_arrived.set()
        if first_token == 2:  # shard 0's last sample: answered once shard 1 is in flight
            waited_out.append(not next_shard_arrived.wait(WAIT_S))

    url, _ = engine(hold)
    rows = rows_of(6)
    backend = VllmBackend(url, None, 2, 30, lambda wait_s: None)
    try:
        shards = list(backend.extract_shards([rows[0:2], rows[2:4], rows[4:6]]))
    finally:
        backend.close()
    assert waited_out == [False], "shard 0's last answer waited for shard 1's requests: the engine drained"
    for shard, (states, ready) in enumerate(shards):
        assert ready is None
        assert [s.sample_id for s in states] == [f"s{2 * shard}", f"s{2 * shard + 1}"]
        assert [float(s.aux[0, 0, 0]) for s in states] == [2 * shard + 1, 2 * shard + 2], "each sample's own file"


def test_a_failed_shard_stops_the_requests_queued_behind_it(engine, tmp_path):
    def hold(first_token: int) -> None:
        if first_token != 1:
            threading.Event().wait(0.5)

    url, handler = engine(hold, refused=frozenset({1}))
    rows = rows_of(6)
    backend = VllmBackend(url, None, 1, 30, lambda wait_s: None)
    try:
        with pytest.raises(ServerAnswerError, match="sample s0: server answered 400"):
            list(backend.extract_shards([rows[0:2], rows[2:4], rows[4:6]]))
    finally:
        backend.close()
    assert handler.arrivals == [1, 2], "only the request already sent finishes; the queued ones are never sent"
    assert not list(tmp_path.glob("*.safetensors*")), "the finished request's connector file was read and removed"


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


def test_an_answer_whose_file_never_came_fails_with_engine_died_once_the_engine_is_gone(engine):
    waits: list[float] = []

    def exited(wait_s: float) -> str | None:
        waits.append(wait_s)
        return "vLLM server pid 9 (extraction) died: exit code 0" if wait_s > 0 else None

    url, _ = engine(lambda first_token: None, lost=frozenset({2}))
    backend = VllmBackend(url, None, 2, 10, exited)
    try:
        with pytest.raises(EngineDied, match="died: exit code 0") as info:
            backend.extract(rows_of(2))
    finally:
        backend.close()
    assert waits and waits[0] > 0, "a missing file waits for the engine to exit: its worker may have been killed"
    assert not is_deterministic(info.value)


def test_a_missing_file_from_a_running_engine_names_the_sample_and_the_file(engine, tmp_path):
    url, _ = engine(lambda first_token: None, lost=frozenset({2}))
    backend = VllmBackend(url, None, 2, 10, lambda wait_s: None)
    try:
        with pytest.raises(StatesFileError, match=f"sample s1: the connector's file {tmp_path}/2.safetensors") as info:
            backend.extract(rows_of(2))
    finally:
        backend.close()
    assert is_deterministic(info.value)
