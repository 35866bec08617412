"""Training's preflight: layer ids against the target's depth, the draft's architecture against the
target, the disk its states and export take, its device memory and GPUs (`eagle3_core.preflight`). The
parameters it counts are those of the draft training builds (`draft.shape`)."""

from __future__ import annotations

from pathlib import Path

from eagle3_core.artifacts import HiddenStateSet, TargetModel
from eagle3_core.config import PipelineConfig, TrainingConfig
from eagle3_core.draft.shape import parameter_counts, trained_draft_config
from eagle3_core.events import RunEvents
from eagle3_core.files import free_bytes
from eagle3_core.hidden_states.description import StatesDescription
from eagle3_core.preflight import conclude, device_gpus, disk_problem, gpu_check
from eagle3_core.run_layout import RunLayout
from eagle3_core.target.preflight import layer_problem, target_files_problems

# fp32 weights plus AdamW's two moments per trainable parameter in one training state file.
STATE_BYTES_PER_PARAMETER = 12
# Training device memory per trainable parameter: fp32 weight, gradient and AdamW's two moments.
TRAIN_BYTES_PER_PARAMETER = 16
# Per frozen parameter (the target's embedding the draft reads), held in fp32.
FROZEN_BYTES_PER_PARAMETER = 4


def draft_parameters(
    training: TrainingConfig,
    target: TargetModel,
    draft_vocab_size: int,
    layer_ids: list[int],
    engines: list[str] | tuple[str, ...] = ("vllm",),
) -> tuple[int, int]:
    """(trainable, frozen) parameters of the draft training trains for this target (its architecture,
    recipe flags as served in `engines` and `freeze_lm_head`: `draft.shape`). ValueError where the
    architecture does not fit."""
    shape = trained_draft_config(training, target, draft_vocab_size, layer_ids, engines)
    return parameter_counts(shape, training.freeze_lm_head)


def training_memory_bytes(trainable: int, frozen: int) -> int:
    """Device memory of the draft's weights, gradients and optimizer state in each training process (DDP
    keeps a whole draft per GPU); activations, which grow with `training.max_length`, come on top."""
    return trainable * TRAIN_BYTES_PER_PARAMETER + frozen * FROZEN_BYTES_PER_PARAMETER


def checkpoint_bytes(parameters: int, keep: int) -> int:
    """Disk the training states (`keep` plus the one being written) and the export take."""
    state = parameters * STATE_BYTES_PER_PARAMETER
    return (keep + 1) * state + parameters * 4


def preflight_training(
    config: PipelineConfig,
    hidden_states: HiddenStateSet | StatesDescription,
    target: TargetModel,
    draft_vocab_size: int,
    out_dir: Path,
    events: RunEvents | None,
) -> None:
    """`hidden_states`: a stored set, or the description of the states online training asks for (its layer ids
    are checked). `events` None: a torchrun rank other than the main one (it checks, the main rank records)."""
    tc = config.training
    layers = layer_problem(hidden_states.layer_ids, target.num_layers, "hidden_states.layer_ids")
    parameters, frozen, architecture = 0, 0, None
    if not layers:
        try:
            parameters, frozen = draft_parameters(
                tc, target, draft_vocab_size, list(hidden_states.layer_ids), config.export.engines
            )
        except ValueError as error:
            architecture = f"training.draft_architecture: {error} ({target.root_path / 'config.json'})"
    needed = checkpoint_bytes(parameters, tc.keep_checkpoints)
    free = free_bytes(out_dir)
    gpus = device_gpus(tc.device)
    checks = {
        "disk_needed": needed,
        "disk_free": free,
        "draft_parameters": parameters,
        "memory_estimate": training_memory_bytes(parameters, frozen),
        "gpus": gpus,
    }
    problems = [
        layers,
        architecture,
        disk_problem(out_dir, needed, free, RunLayout.of(config).kept_results),
        *target_files_problems(target),
        gpu_check(gpus, check_busy=False),
    ]
    conclude("training", events, checks, problems)
