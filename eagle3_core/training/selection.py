"""Which weights a training run keeps, by validation. The draft is validated at the end of every epoch and
of the run (`validation_due`). With `training.epochs: auto` the run stops after `training.stop_patience`
validations in a row that do not improve `val_decode_acceptance_length` (the acceptance a greedy decode
of each validation response meets: what predicts served acceptance) on the best so far (`stop_decision`),
and keeps the best validation's weights (`best_validation`), written beside the resumable state whenever
one improves (`state.save_best`): a run killed after any epoch resumes with the same best and patience
(the validations are in its state) and keeps the same weights. With numeric epochs the validations only
draw the curve: the run keeps its final weights and reports the last validation."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn

from eagle3_core.events import DECISION, RunEvents
from eagle3_core.phases import TRAINING
from eagle3_core.training.curves import TrainingCurves
from eagle3_core.training.distributed import Group, barrier
from eagle3_core.training.state import best_path, save_best, set_model_state

METRIC = "val_decode_acceptance_length"
ROW_FIELDS = ("step", "epoch")  # a validation row: these, then `validate`'s metrics


def validation_due(step: int, steps_per_epoch: int, total: int) -> bool:
    """Whether the draft is validated after `step`: at the end of every epoch and at the end of the run."""
    return step % steps_per_epoch == 0 or step == total


def best_index(validations: Sequence[dict[str, float]]) -> int:
    """Index of the validation with the highest `METRIC`, the earliest of equals (a later one must improve)."""
    scores = [row[METRIC] for row in validations]
    return scores.index(max(scores))


def best_validation(validations: Sequence[dict[str, float]]) -> dict[str, float]:
    """The validation whose weights an `auto` run keeps (`best_index`)."""
    return validations[best_index(validations)]


def since_best(validations: Sequence[dict[str, float]]) -> int:
    """Validations after the best one: none improved on it."""
    return len(validations) - 1 - best_index(validations)


def stop_decision(validations: Sequence[dict[str, float]], patience: int) -> bool:
    """Whether training stops: the last `patience` validations did not improve on the best before them."""
    return bool(validations) and since_best(validations) >= patience


def choice_message(validations: Sequence[dict[str, float]], stopped: bool, budget_epochs: float) -> str:
    """The decision line of an `auto` run: where it stopped, why, and which epoch it keeps."""
    best, last = best_validation(validations), validations[-1]
    kept = f"kept epoch {best['epoch']:g} (step {best['step']:g})"
    if not stopped:
        return (
            f"trained to epoch {last['epoch']:g} of at most {budget_epochs:g} without a stop: best {METRIC} "
            f"{best[METRIC]:.3f} at epoch {best['epoch']:g}; {kept}"
        )
    relation = "<" if last[METRIC] < best[METRIC] else "="
    misses = since_best(validations)
    run = f" ({misses} validations without improvement)" if misses > 1 else ""
    return (
        f"stopped after epoch {last['epoch']:g} of at most {budget_epochs:g}: {METRIC} {last[METRIC]:.3f} "
        f"{relation} best {best[METRIC]:.3f} (epoch {best['epoch']:g}){run}; {kept}"
    )


def validation_metrics(row: dict[str, float]) -> dict[str, float]:
    """`validate`'s metrics of a validation row."""
    return {k: v for k, v in row.items() if k not in ROW_FIELDS}


class EpochSelection:
    """The validations of one run (restored from its state on resume) and, with `keep_best` (epochs
    auto), the best validated weights: `after` validates when due and writes an improvement's weights,
    `stopped` says the run is over, `finish` restores the kept weights and says what was kept.

    `measure` validates the weights validated and `weights` returns those weights as a full CPU state
    (both collectives: every rank calls them); the loop defines both side by side."""

    def __init__(
        self,
        keep_best: bool,
        patience: int,
        steps_per_epoch: int,
        total: int,
        state_dir: Path,
        group: Group,
        curves: TrainingCurves,
        validations: list[dict[str, float]],
    ):
        self.keep_best, self.patience = keep_best, patience
        self.steps_per_epoch, self.total = steps_per_epoch, total
        self.state_dir, self.group, self.curves = state_dir, group, curves
        self.validations = validations

    @property
    def stopped(self) -> bool:
        return self.keep_best and stop_decision(self.validations, self.patience)

    @property
    def best_step(self) -> int | None:
        """The step whose weights are kept (saved beside the state), or None where none are."""
        return int(best_validation(self.validations)["step"]) if self.keep_best and self.validations else None

    def after(
        self, step: int, measure: Callable[[], dict[str, float]], weights: Callable[[], dict[str, torch.Tensor]]
    ) -> bool:
        """Validate after `step` when due (recorded in the curves), keeping the weights of an improvement;
        returns whether it validated."""
        if not validation_due(step, self.steps_per_epoch, self.total):
            return False
        metrics = measure()
        self.validations.append({"step": step, "epoch": round(step / self.steps_per_epoch, 2), **metrics})
        self.curves.validation(step, metrics)
        if self.best_step == step:
            model = weights()
            if self.group.is_main:
                save_best(self.state_dir, step, model)
            barrier(self.group)
        return True

    def finish(self, module: nn.Module, events: RunEvents) -> tuple[int | None, dict[str, float]]:
        """(the step whose weights the run keeps, None for the final ones; the metrics to report): with
        `keep_best`, the best validation's weights are loaded into `module`, and the choice is recorded."""
        if not self.validations:
            return None, {}
        if not self.keep_best:
            return None, validation_metrics(self.validations[-1])
        best = best_validation(self.validations)
        best_weights = torch.load(best_path(self.state_dir, int(best["step"])), map_location="cpu", weights_only=True)
        set_model_state(module, best_weights)
        last = self.validations[-1]
        if self.group.is_main:
            budget = self.total / self.steps_per_epoch
            message = choice_message(self.validations, self.stopped, budget)
            events.record(TRAINING.name, DECISION, message, kept_step=best["step"], kept_epoch=best["epoch"])
        chosen = {"kept_step": best["step"], "kept_epoch": best["epoch"], "trained_epochs": last["epoch"]}
        return int(best["step"]), {**validation_metrics(best), **chosen}
