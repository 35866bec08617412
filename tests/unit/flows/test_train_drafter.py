"""The train-drafter flow's order of phases: what it refuses before the first engine starts; a run folder another
process writes is refused by the flows themselves."""

from __future__ import annotations

import pytest

from eagle3_core.config import ConfigError, PipelineConfig
from eagle3_core.run_lock import RunDirBusy
from flows.regenerate import regenerate
from flows.train_drafter import run_all_phases, train_drafter
from tests.helpers.bad_input import run_dir_holder
from tests.helpers.targets import smollm2_shaped_target


class RecordingRunner:
    """Stands in for the flow's PhaseRunner: returns the target for prepare_target, records every phase."""

    def __init__(self, num_layers: int):
        self.target = smollm2_shaped_target().model_copy(update={"num_layers": num_layers})
        self.phases: list[str] = []

    def __call__(self, task, phase: str, *upstream, **options):
        self.phases.append(phase)
        if phase != "prepare_target":
            raise RuntimeError(f"{phase} ran")
        return self.target


@pytest.mark.parametrize(("layers", "layer_ids", "message"), [
    (4, None, r"extraction\.layer_ids: a target needs at least 6 decoder layers"),
    (30, [2, 15, 30], r"extraction\.layer_ids: "),
])  # fmt: skip
def test_extraction_layers_that_do_not_fit_the_target_fail_before_sampling(tmp_path, layers, layer_ids, message):
    """On the H200 a 4-layer target sampled first and failed at extraction; for a 1T target that is hours
    of sampling spent before a config mistake shows."""
    runner = RecordingRunner(layers)
    config = PipelineConfig.model_validate({"run_dir": str(tmp_path), "extraction": {"layer_ids": layer_ids}})
    with pytest.raises(ConfigError, match=message):
        run_all_phases(config, runner)
    assert runner.phases == ["prepare_target"]


def test_a_target_that_fits_goes_on_to_sampling(tmp_path):
    runner = RecordingRunner(30)
    with pytest.raises(RuntimeError, match="sampling ran"):
        run_all_phases(PipelineConfig.model_validate({"run_dir": str(tmp_path)}), runner)
    assert runner.phases == ["prepare_target", "sampling"]


@pytest.mark.parametrize(("flow", "body"), [
    (train_drafter, "flows.train_drafter.run_pipeline"),
    (regenerate, "flows.regenerate.regenerate_holding_the_run_dir"),
])  # fmt: skip
def test_a_flow_on_a_run_folder_another_process_writes_is_refused_before_any_phase(tmp_path, monkeypatch, flow, body):
    """A deployment's run (a worker's process, not `eagle3 run`) takes the run folder's lock too."""
    monkeypatch.setattr(body, pytest.fail)
    holder = run_dir_holder(tmp_path / "run", ["eagle3", "sample"])
    try:
        with pytest.raises(RunDirBusy, match=f"in use by pid {holder.pid} .*`eagle3 sample`"):
            flow.fn(PipelineConfig(run_dir=tmp_path / "run"))
    finally:
        holder.kill()
        holder.wait()


class PassingRunner(RecordingRunner):
    """Records every phase and its task, and lets each one pass (a stand-in manifest)."""

    def __init__(self, num_layers: int):
        super().__init__(num_layers)
        self.tasks: dict[str, str] = {}

    def __call__(self, task, phase: str, *upstream, **options):
        self.phases.append(phase)
        self.tasks[phase] = task.fn.__name__
        return self.target if phase == "prepare_target" else object()


def test_online_training_runs_no_extraction_phase(tmp_path):
    runner = PassingRunner(30)
    config = PipelineConfig.model_validate({"run_dir": str(tmp_path), "training": {"data": "online"}})
    run_all_phases(config, runner)
    assert runner.phases == ["prepare_target", "sampling", "vocab", "training", "evaluation"]
    assert runner.tasks["training"] == "train_online_task"
