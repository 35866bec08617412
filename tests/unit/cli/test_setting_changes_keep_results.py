"""Finished work survives every setting change (issue 53, parts 1 and 3), on the CLI with real files: each row
runs a command with one setting, then with a changed one, then with the original again, and asserts the
change's one decision line, that the first run's files are all still on disk (set aside, never deleted), and
that the original setting finds them back, the same files, with nothing sampled or extracted again and no
traceback. Sampling runs against a local OpenAI-compatible stand-in (no engine); extraction on a tiny target."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest
from typer.testing import CliRunner, Result

from cli.main import app
from eagle3_core.artifacts import HiddenStateSet, SampleSet
from eagle3_core.events import DECISION, WEIGHT_LOAD, RunEvents
from eagle3_core.sampling.table import iter_rows
from tests.helpers.extraction_fixtures import build_sample_set
from tests.helpers.openai_standin import OpenAIStandIn, serving

PROMPTS = [f"question {i}" for i in range(6)]


class CountingServer(OpenAIStandIn):
    """Answers every chat completion with its text and temperature; counts the requests per text."""

    model_id = "counting"
    requests: ClassVar[Counter[str]] = Counter()

    def do_POST(self):
        body = self.request_body()
        text = body["messages"][-1]["content"]
        self.requests[text] += 1
        message = {"role": "assistant", "content": f"answer to {text} at {body['temperature']}"}
        usage = {"prompt_tokens": 10, "completion_tokens": 5}
        self.reply(200, {"choices": [{"message": message, "finish_reason": "stop"}], "usage": usage})


@pytest.fixture
def urls():
    """Two stand-ins of one engine: the same server restarted on another port."""
    CountingServer.requests = Counter()
    with serving(CountingServer) as first, serving(CountingServer) as second:
        yield first, second


def invoke(command: str, settings: list[str]) -> Result:
    return CliRunner().invoke(app, [command, *sets(settings)])


def files_of(*folders: Path) -> Counter[str]:
    """The content digests of every file under `folders` (where they lie does not matter: set aside is kept)."""
    digests: Counter[str] = Counter()
    for folder in folders:
        for path in folder.rglob("*") if folder.exists() else ():
            if path.is_file() and not path.name.endswith(".json"):
                digests[hashlib.sha256(path.read_bytes()).hexdigest()] += 1
    return digests


def decisions(run_dir: Path, phase: str) -> list[str]:
    return [e["message"] for e in RunEvents(run_dir).read() if e["phase"] == phase and e["event"] == DECISION]


def sampling_settings(run_dir: Path, prompts: Path, target: Path, url: str) -> list[str]:
    return [
        f"run_dir={run_dir}",
        f"target.model={target}",
        "server.engine=external",
        f"server.url={url}/v1",
        "server.max_model_len=256",
        f"sampling.prompt_files=[{prompts}]",
        "sampling.rows_per_part=2",
    ]


@dataclass(frozen=True)
class SettingChange:
    """One row: the settings of the change (`{url2}` is the second stand-in's URL, `{url}` the first's), the
    decision line it must record (None: none), and the requests the change makes."""

    name: str
    change: tuple[str, ...]
    decision: str | None
    requests_for_change: int


SAMPLING_CHANGES = [
    SettingChange("temperature", ("sampling.temperature=0.5",), "sampling.temperature changed", len(PROMPTS)),
    SettingChange("max_tokens", ("sampling.max_tokens=64",), "sampling.max_tokens changed", len(PROMPTS)),
    SettingChange("server restarted on another port", ("server.url={url2}/v1",), None, 0),
    SettingChange("fewer prompts", ("sampling.max_prompts=2",), None, 0),
    SettingChange("a speed flag of the engine", ('server.extra_args=[--max-num-seqs, "8"]',), None, 0),
    SettingChange("a quantization flag", ("server.extra_args=[--quantization, fp8]",), "server.extra_args", 6),
]


@pytest.mark.parametrize("row", SAMPLING_CHANGES, ids=lambda row: row.name)
def test_a_sampling_setting_changed_and_back_finds_the_first_rows(tmp_path, urls, smollm2_target, row):
    run_dir, prompts = tmp_path / "run", tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": t}) + "\n" for i, t in enumerate(PROMPTS)))
    base = sampling_settings(run_dir, prompts, smollm2_target.root_path, urls[0])
    first = invoke("sample", base)
    assert first.exit_code == 0, first.output
    original = SampleSet.load(run_dir / "samples")
    before = files_of(run_dir / "samples")
    assert sum(CountingServer.requests.values()) == len(PROMPTS)

    change = [s.format(url=urls[0], url2=urls[1]) for s in row.change]
    changed = invoke("sample", [*base, *change])
    assert changed.exit_code == 0 and changed.exception is None, changed.output
    assert sum(CountingServer.requests.values()) == len(PROMPTS) + row.requests_for_change
    lines = decisions(run_dir, "sampling")
    if row.decision is None:
        assert not any("kept in" in line for line in lines), lines
    else:
        [line] = [line for line in lines if "kept in" in line]
        assert line.startswith(row.decision), line
    assert files_of(run_dir / "samples", run_dir / "kept") >= before, "a file of the first run was lost"

    back = invoke("sample", base)
    assert back.exit_code == 0 and back.exception is None, back.output
    assert sum(CountingServer.requests.values()) == len(PROMPTS) + row.requests_for_change, "sampled again"
    again = SampleSet.load(run_dir / "samples")
    assert again.digest == original.digest, "not the same rows in the same files"
    assert again.ok == len(PROMPTS) and not again.unasked


def test_fewer_prompts_filter_and_do_not_delete(tmp_path, urls, smollm2_target):
    run_dir, prompts = tmp_path / "run", tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": t}) + "\n" for i, t in enumerate(PROMPTS)))
    base = sampling_settings(run_dir, prompts, smollm2_target.root_path, urls[0])
    assert invoke("sample", base).exit_code == 0
    fewer = invoke("sample", [*base, "sampling.max_prompts=2"])
    assert fewer.exit_code == 0, fewer.output
    sample_set = SampleSet.load(run_dir / "samples")
    assert sample_set.ok == 2 and sample_set.prompts == 2 and len(sample_set.unasked) == 4
    assert sorted(row["id"] for row in iter_rows(sample_set)) == ["p0", "p1"], "readers skip the rows not asked for"


def test_a_prompt_edited_under_its_id_is_sampled_again_alone(tmp_path, urls, smollm2_target):
    run_dir, prompts = tmp_path / "run", tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": t}) + "\n" for i, t in enumerate(PROMPTS)))
    base = sampling_settings(run_dir, prompts, smollm2_target.root_path, urls[0])
    assert invoke("sample", base).exit_code == 0
    edited = [*PROMPTS[:2], "an edited question", *PROMPTS[3:]]
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": t}) + "\n" for i, t in enumerate(edited)))
    result = invoke("sample", base)
    assert result.exit_code == 0, result.output
    assert CountingServer.requests["an edited question"] == 1 and sum(CountingServer.requests.values()) == 7
    [row] = [r for r in iter_rows(SampleSet.load(run_dir / "samples")) if r["id"] == "p2"]
    assert row["response"] == "answer to an edited question at 0.0"
    assert list((run_dir / "samples").glob("replaced-*.parquet")), "the old answer is kept aside"


def test_a_failed_start_after_a_key_change_loses_nothing(tmp_path, urls, smollm2_target):
    """A new key whose server is unreachable: the run fails with one error line, and the original setting still
    finds every row (set aside, brought back) without a request."""
    run_dir, prompts = tmp_path / "run", tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": t}) + "\n" for i, t in enumerate(PROMPTS)))
    base = sampling_settings(run_dir, prompts, smollm2_target.root_path, urls[0])
    assert invoke("sample", base).exit_code == 0
    original = SampleSet.load(run_dir / "samples")
    failed = invoke("sample", [*base, "sampling.temperature=0.7", "server.url=http://127.0.0.1:9/v1"])
    assert failed.exit_code == 1, failed.output  # its one-line error is issue 53's part 5
    back = invoke("sample", base)
    assert back.exit_code == 0, back.output
    assert SampleSet.load(run_dir / "samples").digest == original.digest
    assert sum(CountingServer.requests.values()) == len(PROMPTS)


def extract_settings(run_dir: Path, target: Path) -> list[str]:
    return [f"run_dir={run_dir}", f"target.model={target}", "extraction.backend=hf", "sampling.holdout_fraction=0",
            "extraction.samples_per_shard=2"]  # fmt: skip


EXTRACTION_CHANGES = [
    SettingChange("samples per shard (a file layout)", ("extraction.samples_per_shard=3",), None, 0),
    SettingChange("storage dtype", ("extraction.dtype=fp8",), "extraction.dtype changed", 1),
    SettingChange("layer ids", ("extraction.layer_ids=[1, 3, 5]",), "extraction.layer_ids, layer_ids changed", 1),
]


@pytest.mark.parametrize("row", EXTRACTION_CHANGES, ids=lambda row: row.name)
def test_an_extraction_setting_changed_and_back_finds_the_first_states(tmp_path, tiny_llama, smollm2_target, row):
    """`requests_for_change` here: full weight loads the change costs (the original setting costs none)."""
    run_dir = tmp_path / "run"
    build_sample_set(run_dir / "samples", smollm2_target.root_path, num_ok=4)
    base = extract_settings(run_dir, tiny_llama.root_path)
    assert invoke("extract", base).exit_code == 0
    original = HiddenStateSet.load(run_dir / "hidden_states")
    before = files_of(run_dir / "hidden_states")
    events = RunEvents(run_dir)
    assert events.count(WEIGHT_LOAD, "extraction") == 1

    changed = invoke("extract", [*base, *row.change])
    assert changed.exit_code == 0 and changed.exception is None, changed.output
    assert events.count(WEIGHT_LOAD, "extraction") == 1 + row.requests_for_change
    lines = decisions(run_dir, "extraction")
    if row.decision is None:
        assert HiddenStateSet.load(run_dir / "hidden_states").digest == original.digest, "resharded or extracted"
    else:
        [line] = [line for line in lines if "kept in" in line]
        assert line.startswith(row.decision), line
    assert files_of(run_dir / "hidden_states", run_dir / "kept") >= before, "a shard of the first run was lost"

    back = invoke("extract", base)
    assert back.exit_code == 0 and back.exception is None, back.output
    assert events.count(WEIGHT_LOAD, "extraction") == 1 + row.requests_for_change, "extracted again"
    assert HiddenStateSet.load(run_dir / "hidden_states").digest == original.digest


def train_settings(run_dir: Path, target: Path) -> list[str]:
    return [*extract_settings(run_dir, target), "vocab.draft_vocab_size=300", "training.max_steps=4",
            "training.ttt_steps=2", "training.max_length=96", "training.checkpoint_every=2",
            "training.holdout_fraction=0.3", "training.device=cpu"]  # fmt: skip


def test_a_training_setting_changed_and_back_resumes_the_first_states(tmp_path, tiny_llama, smollm2_target):
    """The states of the first setting are set aside, not removed, by the change; back, training resumes at
    its last step (nothing trained again) and exports the same weights."""
    run_dir = tmp_path / "run"
    build_sample_set(run_dir / "samples", smollm2_target.root_path, num_ok=6)
    base = train_settings(run_dir, tiny_llama.root_path)
    for command in ("extract", "vocab", "train"):
        result = invoke(command, base)
        assert result.exit_code == 0, result.output
    weights = run_dir / "draft" / "export" / "model.safetensors"
    first_weights, before = weights.read_bytes(), files_of(run_dir / "draft" / "state")

    changed = invoke("train", [*base, "training.lr=0.001"])
    assert changed.exit_code == 0 and changed.exception is None, changed.output
    [line] = [line for line in decisions(run_dir, "training") if "kept in" in line]
    assert line.startswith("training.lr changed"), line
    assert files_of(run_dir / "draft" / "state", run_dir / "kept") >= before, "a training state was lost"

    back = invoke("train", base)
    assert back.exit_code == 0 and back.exception is None, back.output
    resumed = [e for e in RunEvents(run_dir).read() if e["event"] == "resume" and e["phase"] == "training"]
    assert resumed and resumed[-1]["step"] == 4, "trained again from the first step"
    assert weights.read_bytes() == first_weights


@dataclass(frozen=True)
class Damage:
    """One row of part 3: a fault left in a resumable folder, and what the resume decides."""

    name: str
    damage: str  # "truncate", "garbage" or "latest"
    decision: str


DAMAGES = [
    Damage("newest state torn by a full disk", "truncate", "unreadable: resuming from step-00000006.pt"),
    Damage("newest state overwritten", "garbage", "unreadable: resuming from step-00000006.pt"),
    Damage("latest.json unreadable", "latest", ""),
]


@pytest.mark.parametrize("row", DAMAGES, ids=lambda row: row.name)
def test_a_damaged_newest_training_state_falls_back_to_the_one_before(tmp_path, row):
    """A run to step 8 keeps the states of steps 6 and 8; with the newest damaged, a re-run resumes from the
    intact one with one decision line and ends bit for bit where the undamaged run ended."""
    import torch

    from eagle3_core.config import TrainingConfig
    from eagle3_core.events import RESUME
    from eagle3_core.training.loop import run_training
    from tests.helpers.training_data import CPU, synthetic_data, tiny_objective

    config = TrainingConfig(max_steps=8, checkpoint_every=3, lr=3e-3, batch_size=2)
    data, events, state_dir = synthetic_data(6), RunEvents(tmp_path), tmp_path / "state"
    objective, head = tiny_objective()
    run_training(objective, head, data, None, config, state_dir, CPU, events)
    straight = {k: v.clone() for k, v in objective.state_dict().items()}
    newest = state_dir / "step-00000008.pt"
    if row.damage == "truncate":
        newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    elif row.damage == "garbage":
        newest.write_bytes(b"not a state")
    else:
        (state_dir / "latest.json").write_text('{"file": ')

    objective, head = tiny_objective()
    steps, _ = run_training(objective, head, data, None, config, state_dir, CPU, events)
    assert steps == 8 and events.count(RESUME, "training") == 1
    assert all(torch.equal(tensor, straight[name]) for name, tensor in objective.state_dict().items())
    if row.decision:
        [line] = [line for line in decisions(tmp_path, "training") if "unreadable" in line]
        assert row.decision in line and "step-00000008.pt" in line, line


def test_temporary_files_of_dead_writers_are_removed_at_resume_and_a_live_writers_kept(tmp_path, urls, smollm2_target):
    import subprocess

    gone = subprocess.Popen(["true"])  # a pid that has ended
    gone.wait()
    run_dir, prompts = tmp_path / "run", tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": t}) + "\n" for i, t in enumerate(PROMPTS)))
    base = sampling_settings(run_dir, prompts, smollm2_target.root_path, urls[0])
    assert invoke("sample", base).exit_code == 0
    samples = run_dir / "samples"
    killed = samples / f".part-00009.parquet.tmp-{gone.pid}"
    live = samples / ".part-00010.parquet.tmp-1"  # pid 1 runs as long as the machine does
    killed.write_bytes(b"half a part")
    live.write_bytes(b"being written")
    assert invoke("sample", [*base, "sampling.max_prompts=5"]).exit_code == 0
    assert not killed.exists() and live.exists()


def test_a_torn_events_line_is_skipped_and_the_next_line_starts_on_its_own(tmp_path):
    """A short write on a full disk leaves half a line without its newline: every later read still works and
    the next decision is read whole."""
    events = RunEvents(tmp_path)
    events.record("sampling", DECISION, "first")
    with events.path.open("a") as log:
        log.write('{"ts": 1, "phase": "sampling", "event": "decision", "mess')
    events.record("sampling", DECISION, "after the tear")
    assert [e["message"] for e in events.read()] == ["first", "after the tear"]


def test_fewer_samples_then_back_extract_no_shard_again(tmp_path, tiny_llama, smollm2_target):
    """A smaller SampleSet (fewer prompts) changes the last shard's samples: the complete shard of the larger
    set is set aside rather than written over, and the larger set, asked for again, loads no weights."""
    run_dir = tmp_path / "run"
    build_sample_set(tmp_path / "four", smollm2_target.root_path, num_ok=4)
    build_sample_set(tmp_path / "three", smollm2_target.root_path, num_ok=3)
    base, events = extract_settings(run_dir, tiny_llama.root_path), RunEvents(run_dir)
    assert CliRunner().invoke(app, ["extract", "--samples", str(tmp_path / "four"), *sets(base)]).exit_code == 0
    original, before = HiddenStateSet.load(run_dir / "hidden_states"), files_of(run_dir / "hidden_states")
    fewer = CliRunner().invoke(app, ["extract", "--samples", str(tmp_path / "three"), *sets(base)])
    assert fewer.exit_code == 0, fewer.output
    assert events.count(WEIGHT_LOAD, "extraction") == 2, "the shard of other samples is extracted"
    assert files_of(run_dir / "hidden_states", run_dir / "kept") >= before, "a shard of the first run was lost"
    back = CliRunner().invoke(app, ["extract", "--samples", str(tmp_path / "four"), *sets(base)])
    assert back.exit_code == 0 and back.exception is None, back.output
    assert events.count(WEIGHT_LOAD, "extraction") == 2, "extracted again"
    assert HiddenStateSet.load(run_dir / "hidden_states").digest == original.digest
    assert any("1 shards of these samples brought back" in line for line in decisions(run_dir, "extraction"))


def sets(settings: list[str]) -> list[str]:
    return [a for s in settings for a in ("--set", s)]
