"""Prefect task of draft training. Keyed on the training settings (not device, sharding, compilation,
checkpointing or the process count), the upstream manifests and, for a warm start, the content of the
checkpoint started from: the nightly run warm-starts from `current`, a folder whose name stays while its
drafter changes. `training.processes` > 1 runs torchrun as a child of this task, holding the `gpu` slot for
the whole launch, with rank 0's progress and the run's events relayed here (`eagle3_core.training.launch`).
The training curves (`<run_dir>/draft/training_curves.png`) become the `training-curves` artifact."""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.logging import get_run_logger

from eagle3_core.artifacts import DraftCheckpoint, HiddenStateSet, TargetModel, VocabMap
from eagle3_core.config import PipelineConfig
from eagle3_core.training.curves import curves_markdown
from tasks.policy import PhaseCachePolicy, phase_task_options, run_gpu_phase

PHASE = "training"


def warm_start_content(config: PipelineConfig) -> list[tuple[str, int, int]] | None:
    """(file, size, mtime_ns) of every file of the warm-start checkpoint, or None for a fresh start."""
    if config.training.warm_start is None:
        return None
    root = Path(config.training.warm_start).expanduser()
    files = sorted(p for p in root.rglob("*") if p.is_file())
    return [(str(p.relative_to(root)), (st := p.stat()).st_size, st.st_mtime_ns) for p in files]


POLICY = PhaseCachePolicy(
    phase=PHASE,
    version=1,
    include=("training",),
    exclude=(
        "training.device",
        "training.checkpoint_every",
        "training.keep_checkpoints",
        "training.sharding",
        "training.compile",
        "training.processes",
    ),
    extra=warm_start_content,
)


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
    curves = curves_markdown(checkpoint.root_path)
    if curves is not None:
        create_markdown_artifact(curves, key="training-curves", description="Loss, top-1, acceptance, lr, grad norm")
    return checkpoint
