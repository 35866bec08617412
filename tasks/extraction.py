"""Prefect task of phase 3, hidden-state extraction. Keyed on what changes the stored states (backend,
layer ids, storage dtype, shard size, the held-out split), never on batch size, concurrency, device or the
engine's settings: shards are not re-extracted for another compute dtype (docs/operations.md, "Engines, dtypes
and training processes")."""

from __future__ import annotations

from prefect import task

from eagle3_core.artifacts import HiddenStateSet, SampleSet, TargetModel
from eagle3_core.config import PipelineConfig
from eagle3_core.events import RunEvents
from eagle3_core.phases import EXTRACTION
from eagle3_core.serving.shared import SharedServer
from tasks.hosts import run_on_hosts
from tasks.policy import PhaseCachePolicy, phase_task_options, run_gpu_phase

PHASE = EXTRACTION.name

POLICY = PhaseCachePolicy(spec=EXTRACTION)


@task(**phase_task_options(POLICY))
def extract_hidden_states_task(
    config: PipelineConfig, sample_set: SampleSet, target: TargetModel, shared: SharedServer | None = None
) -> HiddenStateSet:
    """Extract the states of every sample not extracted yet (resumes per shard), on its own engine or on
    `shared` (the SharedServer sampling used; part of no cache key)."""
    from eagle3_core.extraction.phase import extract_hidden_states

    return run_gpu_phase(
        PHASE,
        config,
        lambda events, progress: extract_hidden_states(config, sample_set, target, events, progress, shared),
        shared,
    )


@task(**phase_task_options(POLICY))
def extract_on_hosts_task(config: PipelineConfig, sample_set: SampleSet, target: TargetModel) -> HiddenStateSet:
    """Extract on `orchestration.hosts` hosts, a child flow run each (`tasks.hosts`), and merge their slices;
    keyed as one host's extraction (the same states)."""
    from eagle3_core.extraction.merge import merge_slices

    run_on_hosts(config, PHASE, sample_set=sample_set, target=target)
    return merge_slices(config, sample_set, target, RunEvents(config.run_dir))
