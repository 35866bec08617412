"""Prefect task of draft training. Keyed on the training settings marked content (not device, sharding,
compilation or checkpointing), the processes training together (they make the global batch), the upstream
manifests and, for a warm start, the files of the checkpoint started from: the nightly run warm-starts from
`current`, a folder whose name stays while its drafter changes. Online (`training.data: online`,
`train_online_task`) the SampleSet replaces the hidden-state set upstream and extraction's content fields join
the key: they make the states the engine gives. `training.processes` > 1 runs torchrun as a child of this task,
holding the `gpu` slot for the whole launch, with rank 0's progress and the run's events relayed here
(`eagle3_core.training.launch`).
The training curves (`<run_dir>/draft/training_curves.png`) become the `training-curves` artifact."""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.logging import get_run_logger

from eagle3_core.artifacts import DraftCheckpoint, HiddenStateSet, SampleSet, TargetModel, VocabMap
from eagle3_core.config import PipelineConfig
from eagle3_core.files import folder_identity
from eagle3_core.phases import EXTRACTION, KEYED_ROLES, TRAINING, keyed_fields
from eagle3_core.serving.shared import SharedServer
from eagle3_core.training.curves import curves_markdown
from tasks.hosts import run_on_hosts
from tasks.policy import PhaseCachePolicy, phase_task_options, run_gpu_phase

PHASE = TRAINING.name


def training_inputs(config: PipelineConfig) -> Any:
    """The files of the warm-start checkpoint, the processes training together where they are more than one
    (they make the global batch; `training.launch.training_world`), and online extraction's keyed fields
    (offline keys stay as they were)."""
    from eagle3_core.training.launch import training_world

    identity = folder_identity(config.training.warm_start)
    world = training_world(config)
    inputs = identity if world == 1 else {"warm_start": identity, "world": world}
    if config.training.data == "offline":
        return inputs
    return {"warm_start": inputs, "online_states": keyed_fields(config, EXTRACTION.name, KEYED_ROLES)}


POLICY = PhaseCachePolicy(spec=TRAINING, extra=training_inputs)


@task(**phase_task_options(POLICY))
def train_draft_task(
    config: PipelineConfig, hidden_states: HiddenStateSet, vocab_map: VocabMap, target: TargetModel
) -> DraftCheckpoint:
    """Train (or resume training) the draft in `training.processes` processes; exports the vLLM-loadable folder."""
    from eagle3_core.training.launch import train_draft_on_host

    log_line = get_run_logger().info
    checkpoint = run_gpu_phase(
        PHASE,
        config,
        lambda events, progress: train_draft_on_host(
            config, hidden_states, vocab_map, target, events, progress, log_line
        ),
    )
    return with_curves(checkpoint)


@task(**phase_task_options(POLICY))
def train_online_task(
    config: PipelineConfig,
    sample_set: SampleSet,
    vocab_map: VocabMap,
    target: TargetModel,
    shared: SharedServer | None = None,
) -> DraftCheckpoint:
    """Train the draft on the states the extraction engine (its own, or `shared`: the sampling server, part
    of no cache key) computes beside it; no hidden-state set is stored."""
    from eagle3_core.online.phase import train_online

    checkpoint = run_gpu_phase(
        PHASE,
        config,
        lambda events, progress: train_online(config, sample_set, vocab_map, target, events, progress, shared),
        shared,
    )
    return with_curves(checkpoint)


@task(**phase_task_options(POLICY))
def train_on_hosts_task(
    config: PipelineConfig, hidden_states: HiddenStateSet, vocab_map: VocabMap, target: TargetModel
) -> DraftCheckpoint:
    """Train on `orchestration.hosts` hosts: a child flow run each (`tasks.hosts`), each a node of one
    multi-node torchrun; keyed as one host's training (the process count is operational)."""
    from eagle3_core.training.launch import launched_checkpoint

    run_on_hosts(config, PHASE, hidden_states=hidden_states, vocab_map=vocab_map, target=target)
    return with_curves(launched_checkpoint(config, hidden_states, vocab_map, target))


def with_curves(checkpoint: DraftCheckpoint) -> DraftCheckpoint:
    """`checkpoint`, its training curves published as the `training-curves` artifact."""
    curves = curves_markdown(checkpoint.root_path)
    if curves is not None:
        create_markdown_artifact(curves, key="training-curves", description="Loss, top-1, acceptance, lr, grad norm")
    return checkpoint
