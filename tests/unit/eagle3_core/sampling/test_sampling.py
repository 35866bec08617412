"""sample_prompts against a scripted OpenAI-compatible server (no vLLM): retries, error rows, skipped
prompts, reasoning capture, Parquet parts, resume by sample id, responses per prompt, and the manifest's
accounting."""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from typing import ClassVar

import pytest

from eagle3_core.artifacts import ArtifactInvalid, SampleSet
from eagle3_core.config import PipelineConfig, ServerConfig
from eagle3_core.events import CACHE_HIT, RESUME, RunEvents
from eagle3_core.hosts import every_slice
from eagle3_core.sampling import phase as sampling
from eagle3_core.sampling.prompts import PromptFileError
from eagle3_core.sampling.store import merge_slices
from eagle3_core.sampling.table import iter_rows, read_part
from eagle3_core.serving.engine import ExternalServer
from eagle3_core.serving.shared import CONTEXT_MARGIN
from tests.helpers.openai_standin import OpenAIStandIn, serving


class ScriptedServer(OpenAIStandIn):
    """Answers by the user text: FAIL500xN fails N times with 500, FAIL400 always 400, THINK answers with
    <think> tags, PARSED answers through a reasoning field, SEED answers with the request's seed, DIE drops
    the connection."""

    model_id = "scripted"
    requests: ClassVar[Counter[str]] = Counter()

    def do_POST(self):
        body = self.request_body()
        text = body["messages"][-1]["content"]
        self.requests[text] += 1
        if "DIE" in text:
            self.connection.close()
            return
        if "FAIL400" in text:
            return self.reply(400, {"error": "bad request"})
        if "FAIL500x" in text and self.requests[text] <= int(text.split("FAIL500x")[1][0]):
            return self.reply(500, {"error": "engine hiccup"})
        message = {"role": "assistant", "content": f"answer to {text}"}
        if "THINK" in text:
            message["content"] = "<think>pondering</think>answer"
        if "PARSED" in text:
            message["reasoning_content"] = "parsed thoughts"
        if "SEED" in text:
            message["content"] = f"seed {body['seed']}"
        usage = {"prompt_tokens": 10, "completion_tokens": 5}
        self.reply(200, {"choices": [{"message": message, "finish_reason": "stop"}], "usage": usage})


@pytest.fixture
def scripted():
    ScriptedServer.requests = Counter()
    with serving(ScriptedServer) as url:
        yield ExternalServer(f"{url}/v1")


def make_config(tmp_path, texts, **sampling_fields):
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"id": f"p{i}", "prompt": t}) + "\n" for i, t in enumerate(texts)))
    sampling_fields = {"prompt_files": [str(path)], "rows_per_part": 3, "retry_backoff_s": 0.01, **sampling_fields}
    return PipelineConfig(
        run_dir=tmp_path / "run", sampling=sampling_fields, server={"engine": "external", "max_model_len": 64}
    )


TEXTS = ["plain one", "FAIL500x2 flaky", "FAIL400 broken", "THINK please", "PARSED please", "x " * 80, "plain two"]


def test_rows_are_accounted_retried_and_reasoning_captured(tmp_path, scripted, smollm2_target):
    config = make_config(tmp_path, TEXTS)
    updates = []
    sample_set = sampling.sample_prompts(config, smollm2_target, RunEvents(config.run_dir), updates.append, scripted)
    assert (sample_set.prompts, sample_set.ok, sample_set.error, sample_set.skipped) == (7, 5, 1, 1)
    assert sample_set.errors == {"p2": 'HTTP 400: {"error": "bad request"}'}
    assert ScriptedServer.requests["FAIL500x2 flaky"] == 3
    assert ScriptedServer.requests["FAIL400 broken"] == 1
    rows = {r["id"]: r for r in iter_rows(sample_set, status=None)}
    assert rows["p5"]["status"] == "skipped" and "over the 64 a conversation may hold" in rows["p5"]["error"]
    assert (rows["p3"]["reasoning"], rows["p3"]["response"]) == ("pondering", "answer")
    assert (rows["p4"]["reasoning"], rows["p4"]["response"]) == ("parsed thoughts", "answer to PARSED please")
    assert rows["p0"]["finish_reason"] == "stop" and rows["p0"]["completion_tokens"] == 5
    assert len(rows["p0"]["input_ids"]) == len(rows["p0"]["loss_mask"]) > 0
    assert sample_set.tokens == sum(len(r["input_ids"]) for r in rows.values() if r["status"] == "ok")
    assert len([f for f in sample_set.files if f.path.endswith(".parquet")]) == 3
    assert sample_set.config["sampling"]["temperature"] == 0.0
    last = updates[-1]
    assert (last.done, last.total, last.stage) == (7, 7, "requests") and last.message == "1 errors"
    assert re.fullmatch(r"requests: 7/7 requests · [0-9.]+ tok/s · 1 errors", last.line()), last.line()


def test_on_a_target_of_2048_tokens_a_conversation_holds_2048_less_the_extraction_margin(
    tmp_path, scripted, tiny_llama
):
    """The tiny Llama's context is 2048 tokens, server.max_model_len's default too: a conversation of 2048
    would leave the extraction server (which needs CONTEXT_MARGIN more) no context vLLM starts with."""
    config = make_config(tmp_path, ["plain one"])
    config.server.max_model_len = ServerConfig().max_model_len
    events = RunEvents(config.run_dir)
    sample_set = sampling.sample_prompts(config, tiny_llama, events, server=scripted)
    assert sample_set.ok == 1
    [held] = [e for e in events.read() if e["message"].startswith("conversations held to")]
    assert held["max_model_len"] == 2048 - CONTEXT_MARGIN
    assert held["message"].endswith(f"the target's context is 2048 tokens (max_position_embeddings) and "
                                    f"extraction needs {CONTEXT_MARGIN} beyond each")  # fmt: skip


def test_rerun_retries_errors_only_and_a_clean_set_is_a_cache_hit(tmp_path, scripted, smollm2_target):
    config = make_config(tmp_path, TEXTS)
    events = RunEvents(config.run_dir)
    sampling.sample_prompts(config, smollm2_target, events, server=scripted)
    before = Counter(ScriptedServer.requests)
    again = sampling.sample_prompts(config, smollm2_target, events, server=scripted)
    sent = ScriptedServer.requests - before
    assert sent == Counter({"FAIL400 broken": 1})
    assert (again.ok, again.error, again.skipped) == (5, 1, 1)
    assert events.count(RESUME) == 1

    clean = make_config(tmp_path / "clean", ["plain one", "plain two"])
    clean_events = RunEvents(clean.run_dir)
    first = sampling.sample_prompts(clean, smollm2_target, clean_events, server=scripted)
    before = Counter(ScriptedServer.requests)
    second = sampling.sample_prompts(clean, smollm2_target, clean_events, server=scripted)
    assert ScriptedServer.requests == before and second.digest == first.digest
    assert clean_events.count(CACHE_HIT) == 1


def test_unreachable_server_aborts_keeps_rows_and_resume_fills_the_rest(tmp_path, scripted, smollm2_target):
    texts = [f"plain {i}" for i in range(5)] + ["DIE now"] + [f"later {i}" for i in range(4)]
    config = make_config(tmp_path, texts, concurrency=1, max_retries=1)
    with pytest.raises(sampling.SamplingAborted, match="unreachable"):
        sampling.sample_prompts(config, smollm2_target, RunEvents(config.run_dir), server=scripted)
    written = [r["id"] for p in sorted((config.run_dir / "samples").glob("part-*.parquet")) for r in read_part(p)]
    assert written == [f"p{i}" for i in range(5)]

    texts[5] = "alive now"
    config = make_config(tmp_path, texts, concurrency=1)
    before = Counter(ScriptedServer.requests)
    sample_set = sampling.sample_prompts(config, smollm2_target, RunEvents(config.run_dir), server=scripted)
    assert sample_set.ok == 10
    assert sorted(ScriptedServer.requests - before) == sorted(["alive now"] + [f"later {i}" for i in range(4)])


class DyingEngine(ExternalServer):
    """An engine whose core dies on the prompt `FAIL500x9 core died`: from then on the server answers 500
    (as vLLM does for a moment) and `exit_report` reports the process gone."""

    def exit_report(self, wait_s: float = 0) -> str | None:
        if ScriptedServer.requests["FAIL500x9 core died"]:
            return "vLLM server pid 1 (sampling) died: exit code 1; log server/sampling.log"
        return None


def test_a_dying_engine_aborts_at_once_without_error_rows_and_keeps_the_rows_done(tmp_path, scripted, smollm2_target):
    texts = [f"plain {i}" for i in range(4)] + ["FAIL500x9 core died"] + [f"later {i}" for i in range(4)]
    config = make_config(tmp_path, texts, concurrency=1, max_retries=3, retry_backoff_s=30)
    events = RunEvents(config.run_dir)
    begun = time.monotonic()
    with pytest.raises(sampling.SamplingAborted, match="died: exit code 1"):
        sampling.sample_prompts(config, smollm2_target, events, server=DyingEngine(scripted.base_url))
    assert time.monotonic() - begun < 20, "no retry is spent on a dead engine (the first backoff is 30 s)"
    assert ScriptedServer.requests["FAIL500x9 core died"] == 1
    written = [r for p in sorted((config.run_dir / "samples").glob("part-*.parquet")) for r in read_part(p)]
    assert [(r["id"], r["status"]) for r in written] == [(f"p{i}", "ok") for i in range(4)]
    [aborted] = [e for e in events.read() if "reason" in e]
    assert (aborted["sampled"], aborted["left"]) == (4, 5)


def test_changed_sampling_parameters_discard_old_rows(tmp_path, scripted, smollm2_target):
    config = make_config(tmp_path, ["plain one"])
    sampling.sample_prompts(config, smollm2_target, RunEvents(config.run_dir), server=scripted)
    hotter = make_config(tmp_path, ["plain one"], temperature=0.7)
    sampling.sample_prompts(hotter, smollm2_target, RunEvents(config.run_dir), server=scripted)
    assert ScriptedServer.requests["plain one"] == 2


def test_malformed_prompt_file_fails_before_any_request_and_keeps_rows(tmp_path, scripted, smollm2_target):
    config = make_config(tmp_path, ["plain one"])
    sampling.sample_prompts(config, smollm2_target, RunEvents(config.run_dir), server=scripted)
    prompt_file = tmp_path / "prompts.jsonl"
    prompt_file.write_text(prompt_file.read_text() + "{not json\n")
    before = sum(ScriptedServer.requests.values())
    with pytest.raises(PromptFileError, match=r"prompts\.jsonl:2"):
        sampling.sample_prompts(config, smollm2_target, RunEvents(config.run_dir), server=scripted)
    assert sum(ScriptedServer.requests.values()) == before
    assert len(list((config.run_dir / "samples").glob("part-*.parquet"))) == 1


def on_host(config: PipelineConfig, host: int) -> PipelineConfig:
    return config.model_copy(update={"orchestration": config.orchestration.model_copy(update={"host": host})})


def test_hosts_sample_their_slices_and_the_merge_equals_one_host(tmp_path, scripted, smollm2_target):
    texts = [f"SEED {i}" for i in range(12)] + ["FAIL400 broken"]
    one = make_config(tmp_path / "one", texts)
    whole = sampling.sample_prompts(one, smollm2_target, RunEvents(one.run_dir), server=scripted)
    config = make_config(tmp_path / "two", texts)
    config.orchestration.hosts = 2
    for part in every_slice(2):
        sliced = sampling.sample_prompts(
            on_host(config, part.host), smollm2_target, RunEvents(config.run_dir), server=scripted
        )
        assert sliced.root == str(config.run_dir / "samples" / part.name)
        assert all(part.takes(row["id"]) for row in iter_rows(sliced, status=None))
    merged = merge_slices(config, smollm2_target, RunEvents(config.run_dir))
    assert merged.config == whole.config and merged.root == str(config.run_dir / "samples")
    assert (merged.prompts, merged.ok, merged.error, merged.tokens) == (
        whole.prompts,
        whole.ok,
        whole.error,
        whole.tokens,
    )
    assert merged.errors == whole.errors
    rows = {row["id"]: row for row in iter_rows(merged, status=None)}
    assert rows == {row["id"]: row for row in iter_rows(whole, status=None)}
    assert rows["p5"]["response"] == "seed 5"  # the request seed of a prompt's place among every prompt
    assert SampleSet.load(config.run_dir / "samples").digest == merged.digest


def test_a_merge_names_the_host_whose_slice_is_missing_and_a_rerun_redoes_only_it(tmp_path, scripted, smollm2_target):
    texts = [f"plain {i}" for i in range(10)]
    config = make_config(tmp_path, texts, rows_per_part=2)
    config.orchestration.hosts = 2
    for host in (0, 1):
        sampling.sample_prompts(on_host(config, host), smollm2_target, RunEvents(config.run_dir), server=scripted)
    lost = config.run_dir / "samples" / "host-1-of-2"
    (lost / "sample_set.json").unlink()
    parts = sorted(lost.glob("part-*.parquet"))
    gone = {row["id"] for row in read_part(parts[0])}
    parts[0].unlink()  # the host was lost mid-slice: one part never written
    finished = {p: p.stat().st_mtime_ns for p in (config.run_dir / "samples").rglob("part-*.parquet")}
    with pytest.raises(ArtifactInvalid, match="host-1-of-2: host 1 of 2 left no finished sample set"):
        merge_slices(config, smollm2_target, RunEvents(config.run_dir))
    before = Counter(ScriptedServer.requests)
    for host in (0, 1):
        sampling.sample_prompts(on_host(config, host), smollm2_target, RunEvents(config.run_dir), server=scripted)
    assert sorted(ScriptedServer.requests - before) == sorted(texts[int(i[1:])] for i in gone)
    assert all(p.stat().st_mtime_ns == mtime for p, mtime in finished.items())
    assert merge_slices(config, smollm2_target, RunEvents(config.run_dir)).ok == 10


def test_each_response_is_a_row_with_its_own_seed_and_more_responses_sample_only_the_new_ones(
    tmp_path, scripted, smollm2_target
):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "SEED hi"}) + "\n" + json.dumps({"id": "p1", "prompt": "SEED two"}) + "\n")
    fields = {"prompt_files": [str(path)], "temperature": 0.5, "seed": 10}
    one = PipelineConfig(run_dir=tmp_path / "run", sampling=fields, server={"engine": "external"})
    first = sampling.sample_prompts(one, smollm2_target, RunEvents(one.run_dir), server=scripted)
    # The id of a prompt without one (a hash of its messages), as sampling has always written it.
    # Rows are written as the concurrent requests finish, in no promised order.
    assert sorted((r["id"], r["response"]) for r in iter_rows(first)) == [
        ("3c558d6a6b2a0df0", "seed 10"),
        ("p1", "seed 11"),
    ]
    assert first.responses_per_prompt == 1 and "responses_per_prompt" not in first.config["sampling"]

    two = one.model_copy(update={"sampling": one.sampling.model_copy(update={"responses_per_prompt": 2})})
    before = Counter(ScriptedServer.requests)
    both = sampling.sample_prompts(two, smollm2_target, RunEvents(two.run_dir), server=scripted)
    assert ScriptedServer.requests - before == Counter({"SEED hi": 1, "SEED two": 1}), "the first responses kept"
    rows = sorted((r["id"], r["prompt_id"], r["response_index"], r["response"]) for r in iter_rows(both))
    assert rows == [
        ("3c558d6a6b2a0df0", "3c558d6a6b2a0df0", 0, "seed 10"),
        ("3c558d6a6b2a0df0#1", "3c558d6a6b2a0df0", 1, f"seed {10 + 2**32}"),
        ("p1", "p1", 0, "seed 11"),
        ("p1#1", "p1", 1, f"seed {11 + 2**32}"),
    ]
    assert (both.prompts, both.responses_per_prompt, both.ok) == (2, 2, 4)
    assert {k: both.config["sampling"][k] for k in ("responses_per_prompt", "temperature", "seed")} == {
        "responses_per_prompt": 2,
        "temperature": 0.5,
        "seed": 10,
    }
