"""The train-drafter flow's order of phases: what it refuses before the first engine starts."""

from __future__ import annotations

import pytest

from eagle3_core.config import ConfigError, PipelineConfig
from flows.train_drafter import run_all_phases
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
