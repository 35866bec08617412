"""The flow and the CLI make the same cache decision (issue 25): after one operational field of a phase
changes, both reuse what the phase made; after one content field changes, both make it again.

- For every phase, from the real objects: the key the phase task's own Prefect cache policy computes
  (`task.cache_policy.compute_key`, the key the flow looks its stored result up by) and the key the core
  phase compares before reusing its folder (what `eagle3 <command>` decides by). Each phase's task and the
  folders a real run of it needs cost from seconds (vocab) to minutes (sampling, extraction, training and
  evaluation start engines or train): the keys are where the two decisions are made.
- End to end, once, for vocab (the one phase that needs no engine and no weight load): the real task run
  by the train-drafter flow's own `PhaseRunner` in a real Prefect flow run, and the real `eagle3 vocab`
  command; the flow's task state (Cached or Completed) and the CLI's events.jsonl (a `cache_hit` line or
  none) must tell the same story."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from prefect import flow
from typer.testing import CliRunner

from cli.main import app
from eagle3_core.artifacts import SampleSet, TargetModel
from eagle3_core.config import CONTENT, OPERATIONAL, PipelineConfig
from eagle3_core.events import CACHE_HIT, RunEvents
from eagle3_core.phases import field_roles
from eagle3_core.target.prepare import converted_dir
from flows.train_drafter import PhaseRunner
from tasks.evaluation import evaluate_draft_task
from tasks.extraction import extract_hidden_states_task
from tasks.sampling import sample_prompts_task
from tasks.target import prepare_target_task
from tasks.training import train_draft_task
from tasks.vocab import build_vocab_map_task
from tests.helpers.extraction_fixtures import build_sample_set
from tests.helpers.phase_keys import TARGET, core_key

TASKS = {
    "prepare_target": prepare_target_task,
    "sampling": sample_prompts_task,
    "extraction": extract_hidden_states_task,
    "vocab": build_vocab_map_task,
    "training": train_draft_task,
    "evaluation": evaluate_draft_task,
}
# Per phase: (operational field, a new value), (content field, a new value). training.sharding is the
# field of issue 25 that the flow and `eagle3 train` decided differently.
CHANGES: dict[str, tuple[tuple[str, Any], tuple[str, Any]]] = {
    "prepare_target": (("orchestration.retries", 4), ("target.dtype", "float32")),
    "sampling": (("sampling.concurrency", 3), ("sampling.max_tokens", 17)),
    "extraction": (("extraction.samples_per_shard", 5), ("extraction.dtype", "fp8")),
    "vocab": (("orchestration.progress_interval_s", 9.0), ("vocab.draft_vocab_size", 100)),
    "training": (("training.sharding", "fsdp2"), ("training.lr", 3e-4)),
    "evaluation": (("evaluation.cpu_threads", 1), ("evaluation.max_new_tokens", 17)),
}
BASE = {"training": {"optimizer": "adamw"}}  # fsdp2 takes adamw only
GGUF_SHA = "0123456789abcdef" * 4


def with_field(config: PipelineConfig, path: str, value: Any) -> PipelineConfig:
    data = config.model_dump(mode="json")
    section, _, name = path.rpartition(".")
    data[section][name] = value
    return PipelineConfig.model_validate(data)


def flow_key(phase: str, config: PipelineConfig) -> str:
    """The cache key the phase's task computes in a flow run, through its own cache policy (no stored
    result under it: nothing to validate)."""
    task = TASKS[phase]
    context = SimpleNamespace(task=task, result_store=SimpleNamespace(exists=lambda key: False))
    return task.cache_policy.compute_key(context, {"config": config, "target": TARGET}, {})


def cli_key(phase: str, config: PipelineConfig) -> Any:
    """What the core phase (run by `eagle3 <command>`) compares before reusing what it made: for
    prepare_target, the folder it converts the embedded target into and reuses."""
    return converted_dir(config.target, GGUF_SHA) if phase == "prepare_target" else core_key(config, phase)


# Training length by validation (issue 28): `auto`, its budget and its patience change what is trained.
AUTO_EPOCHS = [
    ("training", CONTENT, "training.epochs", "auto"),
    ("training", CONTENT, "training.max_epochs", 6.0),
    ("training", CONTENT, "training.stop_patience", 2),
]
CASES = [
    (phase, role, *change)
    for phase, pair in CHANGES.items()
    for role, change in zip((OPERATIONAL, CONTENT), pair, strict=True)
] + AUTO_EPOCHS


@pytest.mark.parametrize(("phase", "role", "path", "value"), CASES, ids=[f"{c[0]}:{c[2]}" for c in CASES])
def test_the_flow_and_the_cli_reuse_after_an_operational_change_and_rerun_after_a_content_change(
    tmp_path: Path, phase: str, role: str, path: str, value: Any
):
    assert field_roles(phase)[path] == role, f"{path} is not {role} for {phase}: choose another field"
    base = PipelineConfig.model_validate({**BASE, "run_dir": str(tmp_path / "run")})
    changed = with_field(base, path, value)
    flow_reruns = flow_key(phase, changed) != flow_key(phase, base)
    cli_reruns = cli_key(phase, changed) != cli_key(phase, base)
    assert flow_reruns == cli_reruns, f"{phase} after {path} changed: flow re-runs {flow_reruns}, CLI {cli_reruns}"
    assert flow_reruns == (role == CONTENT), f"{phase} after {path} ({role}) changed: re-runs {flow_reruns}"


@flow(name="vocab-decisions")
def vocab_flow(config: PipelineConfig, sample_set: SampleSet, target: TargetModel) -> str:
    """The vocab task as the train-drafter flow runs it; returns its state's name."""
    runner = PhaseRunner(config)
    runner(build_vocab_map_task, "vocab", sample_set, target)
    return runner.phases[-1].state


def cli_vocab(config_file: Path, samples: Path, overrides: list[str]) -> str:
    """`eagle3 vocab`, in this process; "Cached" when it wrote a cache hit of the vocab map, else "Completed"."""
    events = RunEvents(yaml.safe_load(config_file.read_text())["run_dir"])
    hits = events.count(CACHE_HIT, "vocab")
    sets = [item for override in overrides for item in ("--set", override)]
    result = CliRunner().invoke(app, ["vocab", "--config", str(config_file), "--samples", str(samples), *sets])
    assert result.exit_code == 0, result.output
    return "Cached" if events.count(CACHE_HIT, "vocab") > hits else "Completed"


def test_vocab_through_the_flow_and_through_the_cli_decides_alike(prefect_api, smollm2_target, tmp_path: Path):
    samples = build_sample_set(tmp_path / "samples", smollm2_target.root_path)
    (operational, op_value), (content, content_value) = CHANGES["vocab"]
    runs = [[], [f"{operational}={op_value}"], [f"{content}={content_value}"]]  # base, operational, content

    flow_config = PipelineConfig.model_validate({"run_dir": str(tmp_path / "flow")})
    flow_states = []
    for overrides in runs:
        config = flow_config
        for override in overrides:
            config = with_field(config, *override.split("="))
        flow_states.append(vocab_flow(config, samples, smollm2_target))

    config_file = tmp_path / "cli.yaml"
    config_file.write_text(yaml.safe_dump({"run_dir": str(tmp_path / "cli")}))
    cli_states = [cli_vocab(config_file, samples.root_path, overrides) for overrides in runs]

    assert flow_states == cli_states == ["Completed", "Cached", "Completed"], (flow_states, cli_states)
