"""The optimisation loop: AdamW, warmup + cosine decay, gradient clipping, bf16 autocast on GPU,
validation metrics per TTT position with a simulated acceptance length, resumable checkpoints.

The data position is the optimizer step: epoch e's order is a permutation seeded by (seed, e), so step s
always reads the same batch, and a resumed run reads exactly what the uninterrupted run would have.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import torch

from eagle3_core.config import TrainingConfig
from eagle3_core.events import RESUME, RunEvents
from eagle3_core.progress import ProgressCallback, ProgressUpdate, RateMeter, ignore_progress
from eagle3_core.sample_table import is_heldout
from eagle3_core.training.distributed import Group, all_reduce_sum, barrier, wrap
from eagle3_core.training.loss import (
    TargetHead,
    TTTObjective,
    acceptance_counts,
    acceptance_summary,
    scored_rows,
)
from eagle3_core.training.state import gather_state, latest_state, load_state, save_state

PHASE = "training"

Dataset = Sequence[dict[str, torch.Tensor]]


def split_validation(sample_ids: list[str], fraction: float) -> tuple[list[str], list[str]]:
    """Deterministic train/validation split by sample id. Salted: the unsalted hash already decided the
    evaluation hold-out (`sampling.holdout_fraction`), and those samples were never extracted."""
    validation = [s for s in sample_ids if is_heldout(f"draft-validation:{s}", fraction)]
    chosen = set(validation)
    return [s for s in sample_ids if s not in chosen], validation


def lr_factor(step: int, total: int, warmup_ratio: float, min_lr_ratio: float) -> float:
    """Linear warmup over `warmup_ratio` of the steps, then cosine decay to `min_lr_ratio` of the peak."""
    warmup = math.ceil(total * warmup_ratio)
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def rank_batches(num_items: int, batch_size: int, group: Group, seed: int, epoch: int | None) -> list[list[int]]:
    """This rank's batches of item indices: epoch `epoch`'s seeded permutation (None: stored order),
    padded by wrapping so every rank runs the same number of steps."""
    if epoch is None:
        order = list(range(num_items))
    else:
        order = torch.randperm(num_items, generator=torch.Generator().manual_seed(seed * 100_003 + epoch)).tolist()
    per_step = batch_size * group.world
    steps = math.ceil(num_items / per_step)
    padded = (order * math.ceil(steps * per_step / num_items))[: steps * per_step]
    mine = padded[group.rank :: group.world]
    return [mine[i * batch_size : (i + 1) * batch_size] for i in range(steps)]


def collate(
    items: list[dict[str, torch.Tensor]], device: torch.device, pad_multiple: int, ttt_steps: int | None = None
) -> dict[str, torch.Tensor]:
    """Stack packed sequences into [B, T] (T rounded up to `pad_multiple`); padding is its own document
    (id -1) with loss_mask 0, so it is never scored and never seen by real tokens. With `ttt_steps`, also
    the scored rows of every step (`valid`, `scored`: `scored_rows`), computed here on the CPU."""
    length = max(len(item["input_ids"]) for item in items)
    length = math.ceil(length / pad_multiple) * pad_multiple
    fill = {"document_ids": -1}
    batch = {}
    for name in ("aux", "last", "input_ids", "loss_mask", "position_ids", "document_ids"):
        rows = []
        for item in items:
            tensor = item[name]
            pad = torch.full((length - len(tensor), *tensor.shape[1:]), fill.get(name, 0), dtype=tensor.dtype)
            rows.append(torch.cat([tensor, pad]))
        batch[name] = torch.stack(rows)
    if ttt_steps is not None:
        batch["valid"], batch["scored"] = scored_rows(batch["loss_mask"], batch["document_ids"], ttt_steps)
    return {name: tensor.to(device, non_blocking=True) for name, tensor in batch.items()}


def autocast(device: torch.device):
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


@torch.no_grad()
def validate(
    objective: TTTObjective, head: TargetHead, data: Dataset, batch_size: int, group: Group, pad_multiple: int
) -> dict[str, float]:
    """Per TTT position: loss, top-1 agreement with the target's greedy token (whole vocabulary), and the
    simulated acceptance length of greedy chains of `ttt_steps` draft tokens."""
    steps = objective.ttt_steps
    totals = torch.zeros(steps, 3, dtype=torch.float64, device=group.device)
    accepted = torch.zeros(steps, dtype=torch.float64, device=group.device)
    chains = torch.zeros((), dtype=torch.float64, device=group.device)
    for indices in rank_batches(len(data), batch_size, group, 0, None):
        batch = collate([data[i] for i in indices], group.device, pad_multiple, steps)
        with autocast(group.device):
            _, stats, agree, valid = objective(batch, head, exact_top1=True)
        totals += stats.double()
        counts, count = acceptance_counts(agree, valid)
        accepted += counts.to(group.device, torch.float64)
        chains += count
    for tensor in (totals, accepted, chains):
        all_reduce_sum(tensor, group)
    tau, per_position = acceptance_summary(accepted.long().cpu(), int(chains))
    metrics = {"val_acceptance_length": tau, "val_tokens": float(totals[0, 2])}
    for k in range(steps):
        scored = max(float(totals[k, 2]), 1.0)
        metrics[f"val_loss_{k}"] = float(totals[k, 0]) / scored
        metrics[f"val_top1_{k}"] = float(totals[k, 1]) / scored
        metrics[f"val_accept_rate_{k}"] = per_position[k]
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
    stop_after: int | None = None,
) -> tuple[int, dict[str, float]]:
    """Train (resuming from `state_dir` when it holds a state) and return (steps done, metrics).
    `stop_after` ends the process early at that step (as a crash would), after its checkpoint if due."""
    device = group.device
    pad_multiple = 128 if device.type == "cuda" else 1
    objective.to(device)
    head = head.to(device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    module = wrap(objective, group, tc.sharding, early_sync_layer=objective.draft.midlayer)
    params = [p for p in module.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        params, lr=tc.lr, betas=(0.9, 0.95), weight_decay=tc.weight_decay, fused=device.type == "cuda"
    )
    steps_per_epoch = len(rank_batches(len(train_data), tc.batch_size, group, tc.seed, 0))
    total = tc.max_steps or math.ceil(tc.epochs * steps_per_epoch)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, total, tc.warmup_ratio, tc.min_lr_ratio)
    )
    step, history = 0, []
    resume_from = latest_state(state_dir)
    if resume_from is not None:
        restored = load_state(resume_from, module, optimizer, scheduler)
        step, history = restored["step"], restored["history"]
        if restored["position"] != {"epoch": step // steps_per_epoch, "batch": step % steps_per_epoch}:
            raise ValueError(f"{resume_from}: saved data position {restored['position']} does not fit this data")
        if group.is_main:
            events.record(PHASE, RESUME, f"resuming at step {step} of {total} from {resume_from.name}", step=step)
    elif val_data is not None and len(val_data):
        history.append(
            {
                "step": 0,
                **{
                    f"initial_{k}": v
                    for k, v in validate(objective, head, val_data, tc.batch_size, group, pad_multiple).items()
                },
            }
        )
    meter, start_step, tokens_seen = RateMeter(), step, 0.0
    order_epoch, batches = None, []
    while step < total and (stop_after is None or step < stop_after):
        epoch, index = divmod(step, steps_per_epoch)
        if order_epoch != epoch:
            order_epoch, batches = epoch, rank_batches(len(train_data), tc.batch_size, group, tc.seed, epoch)
        batch = collate([train_data[i] for i in batches[index]], device, pad_multiple, objective.ttt_steps)
        with autocast(device):
            loss, stats, _, _ = module(batch, head)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, tc.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        stats = all_reduce_sum(stats.detach().double(), group)
        tokens_seen += float(all_reduce_sum(torch.tensor(float(batch["input_ids"].numel()), device=device), group))
        step += 1
        row = {"step": step, "loss": float(loss.detach()), "lr": scheduler.get_last_lr()[0]}
        row.update({f"top1_{k}": float(stats[k, 1] / stats[k, 2].clamp(min=1)) for k in range(len(stats))})
        history.append(row)
        tokens_per_s = meter.rate(tokens_seen)
        progress(
            ProgressUpdate(
                phase=PHASE,
                stage="steps",
                done=step,
                total=total,
                unit="steps",
                rate=tokens_per_s,
                eta_s=meter.eta(step - start_step, total - start_step),
                message=f"loss {row['loss']:.3f} top1@0 {row['top1_0']:.2f} {tokens_per_s:,.0f} tok/s",
            )
        )
        if step % tc.checkpoint_every == 0 or step == total:
            model_state, optimizer_state = gather_state(module, optimizer)
            if group.is_main:
                position = {"epoch": step // steps_per_epoch, "batch": step % steps_per_epoch}
                save_state(
                    state_dir, step, model_state, optimizer_state, scheduler, position, history, tc.keep_checkpoints
                )
            barrier(group)
    metrics = {k: v for k, v in history[-1].items() if k != "step"} if history else {}
    for row in history:
        metrics.update({k: v for k, v in row.items() if k.startswith("initial_")})
    if step == total and val_data is not None and len(val_data):
        metrics.update(validate(objective, head, val_data, tc.batch_size, group, pad_multiple))
    return step, metrics
