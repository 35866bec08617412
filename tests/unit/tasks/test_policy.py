"""The orchestration policy on real Prefect runs (a temporary Prefect server and database per module):
content cache keys, validation of cache hits, the retry condition, the `gpu` lock, progress artifacts and
fault injection. The tasks here are small real tasks that write and record real files; no vLLM server."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from prefect import flow, task
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey
from prefect.settings import PREFECT_API_URL

from eagle3_core.artifacts import (
    DraftCheckpoint,
    FileRecord,
    HiddenStateSet,
    Manifest,
    SampleSet,
    TargetModel,
    VocabMap,
)
from eagle3_core.config import PipelineConfig
from eagle3_core.events import CACHE_HIT, DECISION, RunEvents
from eagle3_core.faults import ENV, InjectedFault, check_fault, faulting_progress
from eagle3_core.hidden_states.storage import ShardError
from eagle3_core.phases import PhaseSpec
from eagle3_core.progress import ProgressUpdate
from eagle3_core.serving.engine import EngineDied
from tasks.gpu_slot import ensure_concurrency_limit
from tasks.policy import (
    PhaseCachePolicy,
    configured,
    is_deterministic,
    phase_task_options,
    result_storage_dir,
    run_gpu_phase,
    run_phase,
)
from tasks.progress import PrefectProgress, artifact_key
from tasks.sampling import POLICY as SAMPLING_POLICY
from tasks.target import prepare_target_task
from tasks.training import POLICY as TRAINING_POLICY
from tasks.training import train_draft_task

REPO = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.usefixtures("prefect_api")


@pytest.fixture
def config(tmp_path: Path) -> PipelineConfig:
    return PipelineConfig.model_validate(
        {"run_dir": str(tmp_path / "run"), "orchestration": {"retries": 2, "retry_delay_s": 0}}
    )


def key_of(policy: PhaseCachePolicy, config: PipelineConfig, **upstream: Manifest) -> str:
    return json.dumps(policy.key_content(config, upstream), sort_keys=True)


def test_key_ignores_operational_fields_and_follows_content(config: PipelineConfig):
    base = key_of(SAMPLING_POLICY, config)
    faster = config.model_copy(deep=True)
    faster.sampling.concurrency = 64
    faster.server.port = 8123
    faster.orchestration.retries = 5
    assert key_of(SAMPLING_POLICY, faster) == base
    longer = config.model_copy(deep=True)
    longer.sampling.max_tokens = 17
    assert key_of(SAMPLING_POLICY, longer) != base
    target_a = TargetModel.model_validate(TARGET_FIELDS | {"hidden_size": 8})
    target_b = TargetModel.model_validate(TARGET_FIELDS | {"hidden_size": 16})
    assert key_of(SAMPLING_POLICY, config, target=target_a) != key_of(SAMPLING_POLICY, config, target=target_b)


def test_sampling_key_follows_prompt_file_content(config: PipelineConfig, tmp_path: Path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    config.sampling.prompt_files = [str(prompts)]
    before = key_of(SAMPLING_POLICY, config)
    prompts.write_text('{"prompt": "hi"}\n{"prompt": "new"}\n')
    assert key_of(SAMPLING_POLICY, config) != before


def test_training_key_follows_warm_start_content(config: PipelineConfig, tmp_path: Path):
    current = tmp_path / "current"
    current.mkdir()
    (current / "model.safetensors").write_bytes(b"old")
    config.training.warm_start = str(current)
    before = key_of(TRAINING_POLICY, config)
    (current / "model.safetensors").write_bytes(b"newer")
    assert key_of(TRAINING_POLICY, config) != before


TARGET_FIELDS = {
    "root": "/nowhere",
    "name": "t",
    "source": "local",
    "architecture": "LlamaForCausalLM",
    "model_type": "llama",
    "num_layers": 4,
    "vocab_size": 10,
    "tie_word_embeddings": True,
    "config_digest": "c",
    "tokenizer_digest": "t",
    "chat_template": None,
}

UNIT_POLICY = PhaseCachePolicy(spec=PhaseSpec("unit", 1, ("vocab",)))


def write_unit_manifest(config: PipelineConfig, text: str) -> Manifest:
    """A small real phase: write a file under the run dir and return its manifest."""
    root = Path(config.run_dir) / "unit"
    root.mkdir(parents=True, exist_ok=True)
    (root / "data.txt").write_text(text)
    manifest = Manifest(root=str(root), files=[FileRecord.of(root / "data.txt", root)])
    manifest.save()
    return manifest


@task(**phase_task_options(UNIT_POLICY))
def unit_task(config: PipelineConfig) -> Manifest:
    return write_unit_manifest(config, "one")


@task(**phase_task_options(UNIT_POLICY))
def unit_task_edited(config: PipelineConfig) -> Manifest:
    # Same phase and policy, different source: an edited task must still hit the cache.
    return write_unit_manifest(config, "one")


@flow
def unit_flow(config: PipelineConfig, edited: bool = False) -> str:
    chosen = unit_task_edited if edited else unit_task
    return configured(chosen, config, "unit")(config, return_state=True).name


def test_cache_hit_survives_source_edit_and_is_recorded(config: PipelineConfig):
    assert unit_flow(config) == "Completed"
    assert unit_flow(config, edited=True) == "Cached"
    events = RunEvents(config.run_dir)
    assert events.count(CACHE_HIT, "unit") == 1
    stored = list(result_storage_dir(config).iterdir())
    assert [p.name.split("-")[0] for p in stored] == ["unit"]
    record = json.loads(stored[0].read_text())
    assert record["metadata"]["serializer"]["type"] == "json"


def test_cache_hit_with_changed_files_is_recomputed(config: PipelineConfig):
    assert unit_flow(config) == "Completed"
    data = Path(config.run_dir) / "unit" / "data.txt"
    data.write_text("corrupt")
    assert unit_flow(config) == "Completed"
    assert data.read_text() == "one"
    events = RunEvents(config.run_dir)
    assert events.count(CACHE_HIT, "unit") == 0
    assert any("cached result invalid" in e["message"] for e in events.read() if e["event"] == DECISION)
    assert unit_flow(config) == "Cached"


ERRORS_LEFT: list[int] = []


@task(**phase_task_options(UNIT_POLICY))
def sampling_like_task(config: PipelineConfig) -> SampleSet:
    """A SampleSet whose error rows are the next of ERRORS_LEFT (as a sampling run that retried them)."""
    root = Path(config.run_dir) / "samples"
    root.mkdir(parents=True, exist_ok=True)
    (root / "part-00000.parquet").write_text("rows")
    sample_set = SampleSet(root=str(root), files=[FileRecord.of(root / "part-00000.parquet", root)])
    sample_set.error = ERRORS_LEFT.pop(0)
    sample_set.save()
    return sample_set


@flow
def sampling_like_flow(config: PipelineConfig) -> str:
    return configured(sampling_like_task, config, "unit")(config, return_state=True).name


def test_a_sample_set_with_error_rows_is_not_a_final_result(config: PipelineConfig):
    """`eagle3 run` retries error rows as `eagle3 sample` does: a stored SampleSet with errors runs again."""
    ERRORS_LEFT[:] = [2, 0]
    assert sampling_like_flow(config) == "Completed"
    assert sampling_like_flow(config) == "Completed", "the error rows were never retried"
    assert any("2 error rows are retried" in e["message"] for e in RunEvents(config.run_dir).read())
    assert sampling_like_flow(config) == "Cached"


def test_result_storage_is_configurable(config: PipelineConfig, tmp_path: Path):
    config.orchestration.result_storage = tmp_path / "shared-results"
    assert unit_flow(config) == "Completed"
    assert len(list((tmp_path / "shared-results").iterdir())) == 1


def test_prepare_target_is_cached_on_second_run(config: PipelineConfig):
    @flow
    def target_flow(config: PipelineConfig) -> tuple[str, TargetModel]:
        state = configured(prepare_target_task, config, "prepare_target")(config, return_state=True)
        return state.name, state.result()

    first, target = target_flow(config)
    second, cached = target_flow(config)
    assert (first, second) == ("Completed", "Cached")
    assert cached.digest == target.digest and cached.num_layers == 30
    assert RunEvents(config.run_dir).count(CACHE_HIT, "prepare_target") >= 1


ATTEMPTS: list[str] = []


@task(**phase_task_options(PhaseCachePolicy(spec=PhaseSpec("flaky", 1, ("vocab",)))))
def flaky_task(config: PipelineConfig, error: str) -> Manifest:
    ATTEMPTS.append(error)
    if len(ATTEMPTS) == 1:
        raise {
            "connection": ConnectionError("engine went away"),
            "bad_input": ValueError("prompts.jsonl line 3: no messages"),
            "oom": RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"),
            "fault": InjectedFault("drill"),
            "engine_died": EngineDied("vLLM server pid 7 (sampling) died: killed by SIGKILL"),
            "disk_full": OSError(errno.ENOSPC, "No space left on device"),
        }[error]
    return write_unit_manifest(config, error)


@flow
def flaky_flow(config: PipelineConfig, error: str) -> str:
    return configured(flaky_task, config, "flaky")(config, error, return_state=True).name


@pytest.mark.parametrize(
    ("error", "attempts", "final"),
    [
        ("connection", 2, "Completed"),
        ("engine_died", 2, "Completed"),
        ("bad_input", 1, "Failed"),
        ("oom", 1, "Failed"),
        ("fault", 1, "Failed"),
        ("disk_full", 1, "Failed"),
    ],
)
def test_retries_only_transient_failures(config: PipelineConfig, error: str, attempts: int, final: str):
    ATTEMPTS.clear()
    assert flaky_flow(config, error) == final
    assert len(ATTEMPTS) == attempts


def test_deterministic_failures_are_found_in_the_cause_chain():
    try:
        try:
            raise MemoryError
        except MemoryError as exc:
            raise RuntimeError("engine died") from exc
    except RuntimeError as wrapped:
        assert is_deterministic(wrapped)
    assert not is_deterministic(TimeoutError("no response"))


def test_a_dead_engine_is_transient_whatever_its_requests_failed_with_unless_it_ran_out_of_memory():
    try:
        try:
            raise ShardError("sample p3: server answered 500: EngineCore encountered an issue")
        except ShardError as exc:
            raise EngineDied("extraction engine died mid-shard: killed by SIGKILL") from exc
    except EngineDied as died:
        assert not is_deterministic(died)
    assert is_deterministic(EngineDied("died: exit code 1; last errors:\ntorch.OutOfMemoryError: CUDA out of memory"))
    assert is_deterministic(RuntimeError("writing a shard failed: [Errno 28] No space left on device"))
    assert not is_deterministic(OSError(errno.ECONNRESET, "Connection reset by peer"))


def test_fault_points(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(ENV, "sampling:start,training:steps=3")
    with pytest.raises(InjectedFault):
        check_fault("sampling", "start")
    check_fault("sampling", "end")
    check_fault("vocab", "start")
    seen: list[float] = []
    report = faulting_progress("training", lambda u: seen.append(u.done))
    report(ProgressUpdate(phase="training", stage="train", done=2, total=10, unit="steps"))
    with pytest.raises(InjectedFault, match="steps=3"):
        report(ProgressUpdate(phase="training", stage="train", done=3, total=10, unit="steps"))
    assert seen == [2, 3]
    with pytest.raises(InjectedFault):
        run_phase("sampling", lambda: pytest.fail("the phase must not start"))


def test_progress_lines_label_rates_with_their_unit():
    """Issue 14: "57/128 requests · 32.7/s" where 32.7 was tokens/s."""
    sampling = ProgressUpdate(phase="sampling", stage="requests", done=57, total=128, unit="requests", rate=32.7,
                              rate_unit="tok/s")  # fmt: skip
    assert sampling.line() == "requests: 57/128 requests · 32.7 tok/s"
    shards = ProgressUpdate(phase="extraction", stage="shards", done=1, total=4, unit="shards", rate=0.25, eta_s=12,
                            message="1/4 shards written")  # fmt: skip
    assert shards.line() == "shards: 1/4 shards · 0.2 shards/s · ETA 12 s · 1/4 shards written", "unit per second"
    assert shards.details() == "0.2 shards/s · 1/4 shards written", "what the bar itself does not show"


def test_progress_artifacts_are_throttled_and_finish_at_100():
    sent: list[float] = []

    class CountingProgress(PrefectProgress):
        def send(self, key, update):
            sent.append(update.done)
            return super().send(key, update)

    @task
    def reporting_task() -> None:
        progress = CountingProgress(interval_s=60)
        for done in range(1, 51):
            progress(ProgressUpdate(phase="sampling", stage="requests", done=done, total=50, unit="requests"))

    @flow
    def reporting_flow() -> None:
        reporting_task()

    state = reporting_flow(return_state=True)
    assert sent == [1, 50]
    with get_client(sync_client=True) as client:  # the session's server holds other tests' flow runs too
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(
                key=ArtifactFilterKey(any_=[artifact_key("sampling", "requests")]),
                flow_run_id=ArtifactFilterFlowRunId(any_=[state.state_details.flow_run_id]),
            )
        )
    assert artifacts and artifacts[0].type == "progress" and artifacts[0].data == 100.0


def test_the_training_task_publishes_the_training_curves(config, tmp_path, monkeypatch):
    from eagle3_core.training.curves import PLOT_FILE, curves_png
    from tests.helpers.targets import fake_target

    draft_dir = Path(config.run_dir) / "draft"
    draft_dir.mkdir(parents=True)
    rows = [{"kind": "train", "step": s, "loss": 3.0 / s, "top1_0": 0.1 * s, "lr": 1e-3} for s in (1, 2, 3)]
    (draft_dir / PLOT_FILE).write_bytes(curves_png(rows))
    checkpoint = DraftCheckpoint(root=str(draft_dir), step=3)
    monkeypatch.setattr("eagle3_core.training.launch.train_draft", lambda *args, **kwargs: checkpoint)
    ensure_concurrency_limit(config.orchestration.gpu_limit)

    @flow
    def training_flow() -> DraftCheckpoint:
        upstream = (HiddenStateSet(root=str(tmp_path)), VocabMap(root=str(tmp_path)), fake_target(tmp_path))
        return configured(train_draft_task, config, "training")(config, *upstream)  # results under the run

    state = training_flow(return_state=True)
    assert state.result() == checkpoint
    with get_client(sync_client=True) as client:  # the worker's Prefect server holds other tests' runs too
        artifacts = [
            a
            for a in client.read_artifacts()
            if a.key == "training-curves" and a.flow_run_id == state.state_details.flow_run_id
        ]
    assert artifacts and artifacts[0].type == "markdown"
    assert "![training curves](data:image/png;base64," in artifacts[0].data
    assert f"tensorboard --logdir {draft_dir / 'tensorboard'}" in artifacts[0].data


HOLDER = textwrap.dedent(
    """
    import sys, time
    from prefect import flow
    from tasks.gpu_slot import gpu_slot

    @flow
    def hold(log: str) -> None:
        with gpu_slot("gpu-test"):
            with open(log, "a") as f:
                f.write(f"start {time.time()}\\n")
            time.sleep(3)
            with open(log, "a") as f:
                f.write(f"end {time.time()}\\n")

    hold(sys.argv[1])
    """
)


def test_two_flows_never_hold_gpu_at_once(tmp_path: Path):
    assert ensure_concurrency_limit("gpu-test") == 1
    script = tmp_path / "hold.py"
    script.write_text(HOLDER)
    log = tmp_path / "holds.log"
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, str(script), str(log)], env=env) for _ in range(2)]
    start = time.monotonic()
    assert [p.wait(timeout=180) for p in procs] == [0, 0]
    lines = [line.split() for line in log.read_text().splitlines()]
    assert [kind for kind, _ in lines] == ["start", "end", "start", "end"]
    assert float(lines[2][1]) >= float(lines[1][1])
    assert time.monotonic() - start >= 6


def test_run_gpu_phase_hands_the_phase_its_events_and_progress_between_the_fault_points(tmp_path, monkeypatch):
    config = PipelineConfig(run_dir=tmp_path)
    calls = []

    def phase(events, progress):
        calls.append(events.path)
        progress(ProgressUpdate(phase="sampling", stage="requests", done=3, total=9, unit="requests"))
        return "manifest"

    @task
    def phase_task(fault: str) -> str:
        monkeypatch.setenv(ENV, fault)
        try:
            # `shared`: a shared server holds the gpu slot, so none is taken here.
            return run_gpu_phase("sampling", config, phase, shared=object())
        except InjectedFault as exc:
            return str(exc)

    @flow
    def phase_flow() -> list[str]:
        return [phase_task(fault) for fault in ("", "sampling:requests=3", "sampling:start")]

    done, mid_work, at_start = phase_flow()
    assert done == "manifest" and "requests=3" in mid_work and "start" in at_start
    assert calls == [tmp_path / "events.jsonl"] * 2, "the start fault fires before the phase runs"
