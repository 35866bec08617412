"""Prefect task of the acceptance evaluation. Keyed on the evaluation settings (not device or thread count),
vLLM's settings that change measurement (b), the acceptance floor (a new floor re-judges saved numbers), the
held-out split and the checkpoint, target and sample set measured."""

from __future__ import annotations

from prefect import task

from eagle3_core.artifacts import DraftCheckpoint, EvalReport, SampleSet, TargetModel
from eagle3_core.config import PipelineConfig
from eagle3_core.phases import EVALUATION
from tasks.policy import PhaseCachePolicy, phase_task_options, run_gpu_phase

PHASE = EVALUATION.name

POLICY = PhaseCachePolicy(spec=EVALUATION)


@task(**phase_task_options(POLICY))
def evaluate_draft_task(
    config: PipelineConfig, checkpoint: DraftCheckpoint, target: TargetModel, sample_set: SampleSet
) -> EvalReport:
    """Measure acceptance on held-out prompts with the real target (and vLLM where available)."""
    from eagle3_core.evaluation.phase import evaluate_draft

    return run_gpu_phase(
        PHASE, config, lambda events, progress: evaluate_draft(config, checkpoint, target, sample_set, events, progress)
    )
