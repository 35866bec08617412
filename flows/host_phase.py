"""The `host-phase` flow: one phase of a run spread over hosts, for one host's slice, run by a worker of the
`gpu` pool as a child of the parent's phase task (`tasks.hosts`). It is the ordinary phase task on a config
whose `orchestration.host` names the slice, writing that slice's folders in the shared run directory and
holding this host's GPU slot. Its task is not cached: every slice shares the phase's cache key (the slice is
operational), and the phase resumes from its own folder, so a finished slice returns at once."""

from __future__ import annotations

from typing import Literal

from prefect import flow
from prefect.cache_policies import NO_CACHE

from eagle3_core.artifacts import HiddenStateSet, Manifest, SampleSet, TargetModel, VocabMap
from eagle3_core.config import PipelineConfig
from eagle3_core.hosts import host_slice
from eagle3_core.run_lock import run_dir_lock
from flows.hooks import stop_engines
from tasks.extraction import extract_hidden_states_task
from tasks.hosts import host_gpu_limit
from tasks.policy import configured
from tasks.sampling import sample_prompts_task
from tasks.training import train_draft_task

TASKS = {"sampling": sample_prompts_task, "extraction": extract_hidden_states_task, "training": train_draft_task}


@flow(
    name="host-phase",
    description="One phase (sampling, extraction or a training node) for one host's slice of a run.",
    on_cancellation=[stop_engines],
    on_crashed=[stop_engines],
)
def host_phase(
    config: PipelineConfig,
    phase: Literal["sampling", "extraction", "training"],
    target: TargetModel,
    sample_set: SampleSet | None = None,
    hidden_states: HiddenStateSet | None = None,
    vocab_map: VocabMap | None = None,
) -> Manifest:
    """Run `phase` on this slice (`config.orchestration.host`); its upstream manifests as the phase takes them."""
    config = host_gpu_limit(config)
    upstream: dict[str, tuple[Manifest | None, ...]] = {
        "sampling": (target,),
        "extraction": (sample_set, target),
        "training": (hidden_states, vocab_map, target),
    }
    task = configured(TASKS[phase], config, phase).with_options(cache_policy=NO_CACHE)
    with run_dir_lock(config.run_dir, host_slice(config)):  # one writer of this slice
        return task(config, *upstream[phase])
