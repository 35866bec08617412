"""Prefect task of phase 1, serve and sample. Keyed on the sampling and server settings marked content (what
is generated), and on the prompt files' contents (a file edited in place is new data, under the same name)."""

from __future__ import annotations

from prefect import task

from eagle3_core.artifacts import SampleSet, TargetModel
from eagle3_core.config import PipelineConfig
from eagle3_core.events import RunEvents
from eagle3_core.phases import SAMPLING
from eagle3_core.sampling.prompt_sources import source_digest
from eagle3_core.sampling.prompts import demo_prompts_path
from eagle3_core.serving.shared import SharedServer
from tasks.hosts import run_on_hosts
from tasks.policy import PhaseCachePolicy, phase_task_options, run_gpu_phase

PHASE = SAMPLING.name


def prompt_files_content(config: PipelineConfig) -> dict[str, str]:
    """Prompt source -> the digest of its data files (`demo` is the bundled set; a folder or Hub dataset, all
    of its files); a missing source keys as such (the phase then fails with the error naming it)."""
    return {name: source_digest(name, demo_prompts_path()) for name in config.sampling.prompt_files}


POLICY = PhaseCachePolicy(spec=SAMPLING, extra=prompt_files_content)


@task(**phase_task_options(POLICY))
def sample_prompts_task(config: PipelineConfig, target: TargetModel, shared: SharedServer | None = None) -> SampleSet:
    """Sample every prompt not sampled yet; the phase starts and stops its own engine (try/finally), or
    uses `shared` (a SharedServer the flow stops; part of no cache key)."""
    from eagle3_core.sampling.phase import sample_prompts

    return run_gpu_phase(
        PHASE, config, lambda events, progress: sample_prompts(config, target, events, progress, shared), shared
    )


@task(**phase_task_options(POLICY))
def sample_on_hosts_task(config: PipelineConfig, target: TargetModel) -> SampleSet:
    """Sample on `orchestration.hosts` hosts, a child flow run each (`tasks.hosts`), and merge their slices;
    keyed as one host's sampling (the same rows)."""
    from eagle3_core.sampling.store import merge_slices

    run_on_hosts(config, PHASE, target=target)
    return merge_slices(config, target, RunEvents(config.run_dir))
