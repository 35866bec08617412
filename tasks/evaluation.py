"""Prefect task of the acceptance evaluation. Keyed on the evaluation settings (not request concurrency or device),
the engine's numerics, the held-out split and the checkpoint, target and sample set measured."""

from __future__ import annotations

from prefect import task

from eagle3_core.artifacts import DraftCheckpoint, EvalReport, SampleSet, TargetModel
from eagle3_core.config import PipelineConfig
from eagle3_core.events import RunEvents
from eagle3_core.faults import faulting_progress
from tasks.gpu import gpu_slot
from tasks.policy import SERVER_OPERATIONAL, PhaseCachePolicy, phase_task_options, run_phase
from tasks.progress import PrefectProgress

PHASE = "evaluation"

POLICY = PhaseCachePolicy(
    phase=PHASE,
    version=1,
    include=("server", "evaluation", "sampling.holdout_fraction"),
    exclude=(*SERVER_OPERATIONAL, "evaluation.concurrency", "evaluation.device"),
)


@task(**phase_task_options(POLICY))
def evaluate_draft_task(
    config: PipelineConfig, checkpoint: DraftCheckpoint, target: TargetModel, sample_set: SampleSet
) -> EvalReport:
    """Measure acceptance on held-out prompts with the real target (and vLLM where available)."""
    from eagle3_core.evaluation import evaluate_draft

    with gpu_slot(config.orchestration.gpu_limit, RunEvents(config.run_dir)):
        progress = faulting_progress(PHASE, PrefectProgress(config.orchestration.progress_interval_s))
        return run_phase(
            PHASE,
            lambda: evaluate_draft(
                config, checkpoint, target, sample_set, RunEvents(config.run_dir), progress=progress
            ),
        )
