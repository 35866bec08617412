"""Prefect task of phase 2, hidden-state extraction. Keyed on what changes the stored states (backend,
layer ids, dtype, shard size, the held-out split, the engine's numerics), never on batch size,
concurrency or device."""

from __future__ import annotations

from prefect import task

from eagle3_core.artifacts import HiddenStateSet, SampleSet, TargetModel
from eagle3_core.config import PipelineConfig
from eagle3_core.events import RunEvents
from eagle3_core.faults import faulting_progress
from eagle3_core.shared_server import SharedServer
from tasks.gpu import phase_slot
from tasks.policy import SERVER_OPERATIONAL, PhaseCachePolicy, phase_task_options, run_phase
from tasks.progress import PrefectProgress

PHASE = "extraction"

POLICY = PhaseCachePolicy(
    phase=PHASE,
    version=1,
    include=("server", "extraction", "sampling.holdout_fraction"),
    exclude=(
        *SERVER_OPERATIONAL,
        "extraction.batch_size",
        "extraction.concurrency",
        "extraction.device",
        "extraction.reuse_sampling_server",
        "extraction.reuse_generation_penalty",
        "extraction.reuse_load_gb_per_s",
        "extraction.reuse_generation_tokens_per_s",
        "extraction.writer_threads",
    ),
)


@task(**phase_task_options(POLICY))
def extract_hidden_states_task(
    config: PipelineConfig, sample_set: SampleSet, target: TargetModel, shared: SharedServer | None = None
) -> HiddenStateSet:
    """Extract the states of every sample not extracted yet (resumes per shard), on its own engine or on
    `shared` (the SharedServer sampling used; part of no cache key)."""
    from eagle3_core.extraction import extract_hidden_states

    with phase_slot(config.orchestration.gpu_limit, shared, RunEvents(config.run_dir)):
        progress = faulting_progress(PHASE, PrefectProgress(config.orchestration.progress_interval_s))
        events = RunEvents(config.run_dir)
        return run_phase(
            PHASE, lambda: extract_hidden_states(config, sample_set, target, events, progress=progress, server=shared)
        )
