"""The optimisation loop: AdamW or Muon + AdamW (`training.optimizer`), warmup + cosine or linear decay,
gradient clipping, bf16 autocast on GPU,
validation metrics per TTT position with a simulated acceptance length after every epoch (with `training.epochs:
auto`, stopping when they stop improving and keeping the best epoch: `selection`), resumable checkpoints.

The data position is the optimizer step (`batches.step_batches`), so a resumed run reads exactly what the
uninterrupted run would have. The GPU never waits on the host: the next batches are made ahead
(`batches.BatchPrefetcher`), and a step's loss / top-1 / tokens stay device tensors until the next report
(`report_due`), where every pending step's history row is made with one host sync.
"""

from __future__ import annotations

import math
import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eagle3_core.config import TrainingConfig
from eagle3_core.events import DECISION, RESUME, RunEvents
from eagle3_core.phases import TRAINING
from eagle3_core.progress import ProgressCallback, ProgressUpdate, RateMeter, ignore_progress
from eagle3_core.sampling.table import is_heldout
from eagle3_core.training.batches import (
    BatchPrefetcher,
    Dataset,
    collate,
    epoch_steps,
    followed,
    rank_batches,
    run_steps,
    step_batches,
)
from eagle3_core.training.curves import TrainingCurves
from eagle3_core.training.distributed import Group, all_reduce_sum, barrier, wrap
from eagle3_core.training.ema import WeightAverage, averaged, weight_average
from eagle3_core.training.loss import (
    TargetHead,
    TTTObjective,
    acceptance_counts,
    acceptance_summary,
    decoding_counts,
)
from eagle3_core.training.noise import noise_seed, noisy_aux
from eagle3_core.training.optimizer import build_optimizer
from eagle3_core.training.selection import EpochSelection
from eagle3_core.training.state import gather_state, load_state, model_state, resumable_states, save_state

PHASE = TRAINING.name

# Seconds between reports (progress + history rows), each one host sync; checkpoints and the end always report.
REPORT_INTERVAL_S = 1.0


def split_validation(
    sample_ids: list[str], fraction: float, prompt_ids: list[str] | None = None
) -> tuple[list[str], list[str]]:
    """Deterministic train/validation split by prompt: `prompt_ids[i]` is the prompt of `sample_ids[i]`
    (None: each sample is its own prompt), and every response of a prompt lands on one side. Salted: the
    unsalted hash already decided the evaluation hold-out (`sampling.holdout_fraction`), and those samples
    were never extracted."""
    prompts = sample_ids if prompt_ids is None else prompt_ids
    validation = [s for s, p in zip(sample_ids, prompts, strict=True) if is_heldout(f"draft-validation:{p}", fraction)]
    chosen = set(validation)
    return [s for s in sample_ids if s not in chosen], validation


def lr_factor(step: int, total: int, warmup_ratio: float, min_lr_ratio: float, schedule: str = "cosine") -> float:
    """Linear warmup over `warmup_ratio` of the steps, then `schedule` ("cosine" or "linear") decay to
    `min_lr_ratio` of the peak."""
    warmup = math.ceil(total * warmup_ratio)
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    remaining = 1 - progress if schedule == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
    return min_lr_ratio + (1 - min_lr_ratio) * remaining


def autocast(device: torch.device):
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


@torch.no_grad()
def validate(
    objective: TTTObjective, head: TargetHead, data: Dataset, batch_size: int, group: Group, pad_multiple: int
) -> dict[str, float]:
    """Per TTT position: loss, top-1 agreement with the target's greedy token (whole vocabulary), and two
    simulated acceptance lengths of greedy chains of `ttt_steps` draft tokens: `val_acceptance_length` over
    chains started at every response position, and `val_decode_acceptance_length` over the rounds a greedy
    decode of each response makes (`decoding_counts`: what the serving engine reports)."""
    steps = objective.ttt_steps
    totals = torch.zeros(steps, 3, dtype=torch.float64, device=group.device)
    accepted = torch.zeros(2, steps, dtype=torch.float64, device=group.device)  # every position, decode rounds
    chains = torch.zeros(2, dtype=torch.float64, device=group.device)
    for indices in rank_batches(len(data), batch_size, group, 0, None):
        batch = collate([data[i] for i in indices], group.device, pad_multiple, steps)
        with autocast(group.device):
            _, stats, agree, valid = objective(batch, head, exact_top1=True)
        totals += stats.double()
        for n, (counts, count) in enumerate((acceptance_counts(agree, valid), decoding_counts(agree, valid))):
            accepted[n] += counts.to(group.device, torch.float64)
            chains[n] += count
    for tensor in (totals, accepted, chains):
        all_reduce_sum(tensor, group)
    tau, per_position = acceptance_summary(accepted[0].long().cpu(), int(chains[0]))
    decode_tau, decode_per_position = acceptance_summary(accepted[1].long().cpu(), int(chains[1]))
    metrics = {"val_acceptance_length": tau, "val_decode_acceptance_length": decode_tau}
    metrics["val_tokens"] = float(totals[0, 2])
    for k in range(steps):
        scored = max(float(totals[k, 2]), 1.0)
        metrics[f"val_loss_{k}"] = float(totals[k, 0]) / scored
        metrics[f"val_top1_{k}"] = float(totals[k, 1]) / scored
        metrics[f"val_accept_rate_{k}"] = per_position[k]
        metrics[f"val_decode_accept_rate_{k}"] = decode_per_position[k]
    return metrics


def compile_plan(setting: str, device: torch.device) -> str | None:
    """The soft-CE kernel `TTTObjective.compile` runs with ("triton" on CUDA, "inductor" elsewhere), or None
    to stay eager: `training.compile` "on", "off", or "auto" (compile on CUDA devices only)."""
    if setting == "off" or (setting == "auto" and device.type != "cuda"):
        return None
    return "triton" if device.type == "cuda" else "inductor"


def report_due(step: int, total: int, checkpoint_every: int, since_report_s: float, interval_s: float) -> bool:
    """Whether the pending steps' rows are made now (one host sync): at every checkpoint (its history is
    saved), at the end, and once `interval_s` seconds have passed since the last report."""
    return step % checkpoint_every == 0 or step >= total or since_report_s >= interval_s


def step_record(loss: torch.Tensor, stats: torch.Tensor, tokens: int, group: Group) -> torch.Tensor:
    """One step's numbers as one device tensor, summed over ranks (no host sync): [1 + K*3 + 1] float64 =
    loss, stats [K, 3] (CE sum, top-1 agreements, scored tokens), tokens of the batch."""
    counted = torch.full((1,), float(tokens), dtype=torch.float64, device=stats.device)  # a fill, no copy
    summed = all_reduce_sum(torch.cat([stats.detach().double().flatten(), counted]), group)
    return torch.cat([loss.detach().double().view(1), summed])


def history_row(step: int, lr: float, record: list[float]) -> tuple[dict[str, float], float]:
    """(history row, tokens) of one step from its `step_record` values."""
    loss, stats, tokens = record[0], record[1:-1], record[-1]
    row = {"step": step, "loss": loss, "lr": lr}
    row.update({f"top1_{k}": stats[3 * k + 1] / max(stats[3 * k + 2], 1.0) for k in range(len(stats) // 3)})
    return row, tokens


@dataclass(frozen=True)
class Schedule:
    """How long the run is and where in the data each step reads (the data position is the step)."""

    steps_per_epoch: int
    total: int

    @classmethod
    def of(cls, num_items: int, tc: TrainingConfig, group: Group) -> Schedule:
        """`training.max_steps`, else `training.epochs` (auto: the `max_epochs` budget) of `num_items` items."""
        steps_per_epoch = epoch_steps(num_items, tc.batch_size, group.world)
        epochs = tc.max_epochs if tc.epochs == "auto" else tc.epochs
        return cls(steps_per_epoch, run_steps(steps_per_epoch, tc.max_steps, epochs))

    def position(self, step: int) -> dict[str, int]:
        """The data position after `step` steps, as saved in (and checked against) a training state."""
        return {"epoch": step // self.steps_per_epoch, "batch": step % self.steps_per_epoch}


def place_objective(
    objective: TTTObjective, head: TargetHead, tc: TrainingConfig, group: Group, events: RunEvents
) -> tuple[torch.nn.Module, TargetHead]:
    """The objective on the group's device, compiled as `training.compile` says (recorded) and wrapped for
    DDP/FSDP (`wrap`); the target head in the compute dtype."""
    device = group.device
    objective.to(device)
    loss_kernel = compile_plan(tc.compile, device)
    if loss_kernel is not None:
        objective.compile(loss_kernel=loss_kernel)
    if group.is_main:
        compiled = (
            f"torch.compile of the draft's dense blocks, soft-CE rows by the {loss_kernel} kernel"
            if loss_kernel is not None
            else "eager (nothing compiled)"
        )
        events.record(PHASE, DECISION, f"training.compile={tc.compile} on {device.type}: {compiled}")
    head = head.to(device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    return wrap(objective, group, tc.sharding, early_sync_layer=objective.draft.midlayer), head


def optimizer_and_schedule(
    module: torch.nn.Module, tc: TrainingConfig, schedule: Schedule, device: torch.device
) -> tuple[list[torch.nn.Parameter], torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """(trainable parameters, the optimizer of `training.optimizer` over them, its warmup + decay schedule over
    `schedule.total` steps)."""
    params = [p for p in module.parameters() if p.requires_grad]
    optimizer = build_optimizer(module, tc, device)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, schedule.total, tc.warmup_ratio, tc.min_lr_ratio, tc.lr_schedule)
    )
    return params, optimizer, scheduler


def first_loadable_state(
    state_dir: Path,
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    events: RunEvents | None,
) -> tuple[Path, dict[str, Any]] | None:
    """(file, restored) of the newest kept state that loads (`state.resumable_states`), each damaged newer one
    passed over with a DECISION line naming it; None when none is kept or none loads."""
    damaged: list[str] = []
    for path in resumable_states(state_dir):
        try:
            restored = load_state(path, module, optimizer, scheduler)
        except (RuntimeError, OSError, EOFError, KeyError, ValueError, pickle.UnpicklingError) as exc:
            damaged.append(f"{path.name} ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})")
            continue
        if damaged and events is not None:
            events.record(
                PHASE,
                DECISION,
                f"training state {'; '.join(damaged)} unreadable: resuming from {path.name}",
                damaged=damaged,
            )
        return path, restored
    if damaged and events is not None:
        events.record(PHASE, DECISION, f"no kept training state loads ({'; '.join(damaged)}): training from step 0")
    return None


def resume_or_start(
    state_dir: Path,
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    schedule: Schedule,
    group: Group,
    events: RunEvents,
    initial_metrics: Callable[[], dict[str, float]] | None,
    ema: WeightAverage | None = None,
) -> tuple[int, list[dict[str, float]], list[dict[str, float]]]:
    """(step, history, validations) of the newest state in `state_dir`, restored into module, optimizer,
    scheduler and `ema`; else (0, the `initial_metrics` of the untrained draft, when given, as the history's
    first row, no validations)."""
    loaded = first_loadable_state(state_dir, module, optimizer, scheduler, events if group.is_main else None)
    if loaded is None:
        if initial_metrics is None:
            return 0, [], []
        return 0, [{"step": 0, **{f"initial_{k}": v for k, v in initial_metrics().items()}}], []
    resume_from, restored = loaded
    step, history = restored["step"], restored["history"]
    if ema is not None:
        ema.load_state_dict(restored["ema"])
    if restored["position"] != schedule.position(step):
        raise ValueError(f"{resume_from}: saved data position {restored['position']} does not fit this data")
    if group.is_main:
        events.record(PHASE, RESUME, f"resuming at step {step} of {schedule.total} from {resume_from.name}", step=step)
    return step, history, restored["validations"]


class Cadence:
    """When the loop reports and checkpoints. A step's `step_record` waits on the device until a report is
    due (`report_due`: every checkpoint, the end, and every `interval_s`); the report turns all pending
    records into history rows and progress updates with one host sync, and hands them to `curves`."""

    def __init__(
        self,
        history: list[dict[str, float]],
        schedule: Schedule,
        start_step: int,
        checkpoint_every: int,
        progress: ProgressCallback,
        interval_s: float,
        curves: TrainingCurves,
    ):
        self.history, self.schedule, self.start_step = history, schedule, start_step
        self.checkpoint_every, self.progress, self.interval_s = checkpoint_every, progress, interval_s
        self.curves = curves
        self.meter, self.tokens_seen = RateMeter(), 0.0
        self.pending: list[tuple[int, float, torch.Tensor]] = []  # (step, lr, step_record) not yet reported
        self.last_report = time.monotonic()

    def step_done(self, step: int, lr: float, record: torch.Tensor) -> None:
        self.pending.append((step, lr, record))
        since_report_s = time.monotonic() - self.last_report
        if report_due(step, self.schedule.total, self.checkpoint_every, since_report_s, self.interval_s):
            self.report()

    def checkpoint_due(self, step: int) -> bool:
        return step % self.checkpoint_every == 0 or step == self.schedule.total

    def report(self) -> None:
        total = self.schedule.total
        records = torch.stack([record for _, _, record in self.pending]).tolist() if self.pending else []  # one sync
        for (done, lr, _), values in zip(self.pending, records, strict=True):
            row, tokens = history_row(done, lr, values)
            self.history.append(row)
            self.tokens_seen += tokens
            tokens_per_s = self.meter.rate(self.tokens_seen)
            self.progress(
                ProgressUpdate(
                    phase=PHASE,
                    stage="steps",
                    done=done,
                    total=total,
                    unit="steps",
                    rate=tokens_per_s,
                    rate_unit="tok/s",
                    eta_s=self.meter.eta(done - self.start_step, total - self.start_step),
                    message=f"loss {row['loss']:.3f} top1@0 {row['top1_0']:.2f}",
                )
            )
        self.curves.report(self.pending, records)
        self.pending.clear()
        self.last_report = time.monotonic()


def checkpoint(
    state_dir: Path,
    step: int,
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    schedule: Schedule,
    history: list[dict[str, float]],
    tc: TrainingConfig,
    group: Group,
    selection: EpochSelection,
    ema: WeightAverage | None = None,
) -> None:
    """Save the training state after `step` (gathered from every rank, written by the main one), with the
    validations so far and the best weights they keep, and the weight average when training keeps one
    (every rank holds the same)."""
    model, optimizer_state = gather_state(module, optimizer)
    if group.is_main:
        save_state(
            state_dir,
            step,
            model,
            optimizer_state,
            scheduler,
            schedule.position(step),
            history,
            tc.keep_checkpoints,
            None if ema is None else ema.state_dict(),
            selection.validations,
            selection.best_step,
        )
    barrier(group)


def final_metrics(history: list[dict[str, float]]) -> dict[str, float]:
    """The last history row's numbers and the untrained draft's (`initial_*`)."""
    metrics = {k: v for k, v in history[-1].items() if k != "step"} if history else {}
    for row in history:
        metrics.update({k: v for k, v in row.items() if k.startswith("initial_")})
    return metrics


def run_training(
    objective: TTTObjective,
    head: TargetHead,
    train_data: Dataset,
    val_data: Dataset | None,
    tc: TrainingConfig,
    state_dir: Path,
    group: Group,
    events: RunEvents,
    progress: ProgressCallback = ignore_progress,
    report_interval_s: float = REPORT_INTERVAL_S,
    curves: TrainingCurves | None = None,
) -> tuple[int, dict[str, float]]:
    """Train (resuming from `state_dir` when it holds a state) and return (steps done, metrics).
    Progress and history rows of every step, made at most every `report_interval_s` (`Cadence`);
    `curves` (TensorBoard events and the PNG, `curves.TrainingCurves`) get them at the same reports, and
    the validations after every epoch (`selection.EpochSelection`: with `training.epochs: auto` they
    decide when the run stops and which weights it keeps; the metrics are then the kept step's).
    With `training.ema_decay`, validation runs on the weight average and `objective` ends holding it (or the
    best epoch's average, with auto); `training.input_noise` and `training.loss_on_prompt` change the training
    steps only."""
    curves = curves or TrainingCurves(None)
    device = group.device
    pad_multiple = 128 if device.type == "cuda" else 1
    module, head = place_objective(objective, head, tc, group, events)
    ema = weight_average(objective, tc.ema_decay)  # after `wrap`: from the weights every rank starts with
    validating = val_data is not None and len(val_data) > 0
    keep_best = tc.epochs == "auto"
    if keep_best and not validating:
        raise ValueError("training.epochs auto stops by validation: training.holdout_fraction kept no samples")

    # The weights validated and the weights a best epoch keeps: the same, defined here side by side.
    def validation() -> dict[str, float]:
        with averaged(ema):
            return validate(objective, head, val_data, tc.batch_size, group, pad_multiple)

    def validated_weights() -> dict[str, torch.Tensor]:
        with averaged(ema):  # copies: on a CPU the state's tensors are the weights the block then restores
            return {name: tensor.clone() for name, tensor in model_state(module).items()}

    schedule = Schedule.of(len(train_data), tc, group)
    params, optimizer, scheduler = optimizer_and_schedule(module, tc, schedule, device)
    step, history, validations = resume_or_start(
        state_dir, module, optimizer, scheduler, schedule, group, events, validation if validating else None, ema
    )
    selection = EpochSelection(
        keep_best, tc.stop_patience, schedule.steps_per_epoch, schedule.total, state_dir, group, curves, validations
    )
    curves.start(step, history)
    cadence = Cadence(history, schedule, step, tc.checkpoint_every, progress, report_interval_s, curves)
    plan = step_batches(len(train_data), tc.batch_size, group, tc.seed, schedule.steps_per_epoch, step, schedule.total)
    plan = followed(train_data, plan)  # online: the engine is asked for these steps' states ahead
    with BatchPrefetcher(
        train_data, plan, device, pad_multiple, objective.ttt_steps, loss_on_prompt=tc.loss_on_prompt
    ) as batches:
        while step < schedule.total and not selection.stopped:
            batch = batches.next()
            if tc.input_noise:
                batch["aux"] = noisy_aux(batch, tc.input_noise, noise_seed(tc.seed, step, group.rank))
            with autocast(device):
                loss, stats, _, _ = module(batch, head)
            loss.backward()
            curves.step(torch.nn.utils.clip_grad_norm_(params, tc.grad_clip))  # a device tensor, read at reports
            optimizer.step()
            if ema is not None:
                ema.update()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            record = step_record(loss, stats, batch["input_ids"].numel(), group)
            cadence.step_done(step, scheduler.get_last_lr()[0], record)
            validated = validating and selection.after(step, validation, validated_weights)
            if cadence.checkpoint_due(step) or (keep_best and validated):  # auto saves every validation (a stop)
                if cadence.pending:  # a validation between checkpoints: its steps' rows go into the state too
                    cadence.report()
                checkpoint(state_dir, step, module, optimizer, scheduler, schedule, history, tc, group, selection, ema)
    cadence.report()
    if ema is not None and not keep_best:  # with auto, `finish` loads the best epoch's average
        ema.apply()
    kept_step, kept_metrics = selection.finish(module, events)
    metrics = final_metrics([row for row in history if kept_step is None or row["step"] <= kept_step])
    metrics.update(kept_metrics)
    curves.close()
    return step, metrics
