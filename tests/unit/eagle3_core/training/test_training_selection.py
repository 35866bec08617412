"""Training length by validation (`training.epochs: auto`): the stopping rule, a run that stops early and
keeps its best epoch's weights, the same choice after a kill and a resume, and numeric epochs that
validate every epoch but keep training and reporting as before."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from eagle3_core.config import ConfigError, TrainingConfig, load_config
from eagle3_core.events import DECISION, RESUME, RunEvents
from eagle3_core.faults import ENV, InjectedFault, faulting_progress
from eagle3_core.progress import ignore_progress
from eagle3_core.training import loop
from eagle3_core.training.loop import run_training, validate
from eagle3_core.training.selection import (
    METRIC,
    best_validation,
    choice_message,
    stop_decision,
    validation_due,
)
from eagle3_core.training.state import best_path, latest_state
from tests.helpers.training_data import CPU, synthetic_data, tiny_objective

DATA = synthetic_data(6)  # batch 2: 3 steps an epoch
VAL = DATA[:2]


def rows(*scores: float) -> list[dict[str, float]]:
    """Validations after epochs 1, 2, ... of 3 steps with these `METRIC` scores."""
    return [{"step": 3 * (e + 1), "epoch": e + 1, METRIC: s} for e, s in enumerate(scores)]


def test_the_run_stops_after_patience_validations_that_do_not_improve_on_the_best() -> None:
    assert not stop_decision([], 1) and not stop_decision(rows(2.0), 1)
    assert not stop_decision(rows(2.0, 2.1), 1)
    assert stop_decision(rows(2.0, 2.1, 2.05), 1) and not stop_decision(rows(2.0, 2.1, 2.05), 2)
    assert stop_decision(rows(2.0, 2.0), 1), "an equal score is no improvement"
    assert stop_decision(rows(2.0, 2.1, 2.05, 2.08), 2), "better than the last, still not better than the best"
    assert not stop_decision(rows(2.0, 2.1, 2.05, 2.2), 2)
    assert best_validation(rows(2.0, 2.1, 2.1))["epoch"] == 2, "the earliest of equals"


def test_validation_is_due_after_every_epoch_and_at_the_end() -> None:
    assert [s for s in range(1, 11) if validation_due(s, 3, 10)] == [3, 6, 9, 10]


def test_the_decision_line_says_where_it_stopped_why_and_what_it_kept() -> None:
    stopped = choice_message(rows(2.0, 2.14, 2.10), True, 4.0)
    assert stopped == (
        f"stopped after epoch 3 of at most 4: {METRIC} 2.100 < best 2.140 (epoch 2); kept epoch 2 (step 6)"
    )
    assert "(2 validations without improvement)" in choice_message(rows(2.14, 2.0, 2.14), True, 4.0)
    assert choice_message(rows(2.0, 2.2), False, 2.0).startswith("trained to epoch 2 of at most 2 without a stop")


def test_auto_needs_a_validation_split(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"training\.holdout_fraction"):
        load_config(None, ["training.epochs=auto", "training.holdout_fraction=0"])
    assert load_config(None, ["training.epochs=auto"]).training.epochs == "auto"
    objective, head = tiny_objective()
    with pytest.raises(ValueError, match="holdout_fraction kept no samples"):
        run_training(objective, head, DATA, [], TrainingConfig(epochs="auto"), tmp_path, CPU, RunEvents(tmp_path))


def scripted(monkeypatch: pytest.MonkeyPatch, scores: list[float]) -> None:
    """Every validation (the untrained draft's first) returns the next of `scores`."""
    values = iter(scores)
    monkeypatch.setattr(loop, "validate", lambda *args: {METRIC: next(values), "val_loss_0": 0.0})


def auto(**overrides) -> TrainingConfig:
    return TrainingConfig(epochs="auto", max_epochs=5, checkpoint_every=100, lr=3e-3, batch_size=2, **overrides)


def trainable(objective: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in objective.state_dict().items() if k != "draft.embed_tokens.weight"}


@pytest.fixture(scope="module")
def numeric_states(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, torch.Tensor]]:
    """The weights after every epoch of a plain 5-epoch run (no validation): the steps an auto run with a
    budget of 5 epochs trains, since its schedule spans them."""
    state_dir = tmp_path_factory.mktemp("numeric")
    objective, head = tiny_objective()
    tc = TrainingConfig(epochs=5, checkpoint_every=3, keep_checkpoints=10, lr=3e-3, batch_size=2)
    run_training(objective, head, DATA, None, tc, state_dir, CPU, RunEvents(state_dir))
    load = lambda step: torch.load(state_dir / f"step-{step:08d}.pt", weights_only=False)["model"]  # noqa: E731
    return {step: load(step) for step in range(3, 16, 3)}


def assert_weights(objective: torch.nn.Module, expected: dict[str, torch.Tensor]) -> None:
    got = trainable(objective)
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


def test_auto_stops_after_the_first_epoch_that_does_not_improve_and_keeps_the_best(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, numeric_states
) -> None:
    scripted(monkeypatch, [1.0, 1.5, 1.8, 1.7])  # untrained, epochs 1..3
    objective, head = tiny_objective()
    events = RunEvents(tmp_path)
    steps, metrics = run_training(objective, head, DATA, VAL, auto(), tmp_path / "state", CPU, events)
    assert steps == 9
    assert_weights(objective, numeric_states[6])
    assert metrics[METRIC] == 1.8 and metrics["initial_" + METRIC] == 1.0
    assert (metrics["kept_step"], metrics["kept_epoch"], metrics["trained_epochs"]) == (6, 2, 3)
    assert metrics["lr"] == torch.load(latest_state(tmp_path / "state"), weights_only=False)["history"][6]["lr"]
    decisions = [e["message"] for e in events.read() if e["event"] == DECISION and "kept epoch" in e["message"]]
    assert decisions == [
        f"stopped after epoch 3 of at most 5: {METRIC} 1.700 < best 1.800 (epoch 2); kept epoch 2 (step 6)"
    ]
    assert sorted(p.name for p in (tmp_path / "state").glob("best-*.pt")) == [best_path(Path(), 6).name]


def test_auto_with_a_weight_average_keeps_the_best_epochs_average(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, numeric_states
) -> None:
    scripted(monkeypatch, [1.0, 1.5, 1.8, 1.7])  # as above: epoch 2 is the best
    objective, head = tiny_objective()
    state_dir = tmp_path / "state"
    run_training(objective, head, DATA, VAL, auto(ema_decay=0.5), state_dir, CPU, RunEvents(tmp_path))
    average = torch.load(state_dir / "step-00000006.pt", weights_only=False)["ema"]
    got = trainable(objective)
    for name, tensor in average.items():  # the average validated at epoch 2, not the final weights' average
        assert torch.equal(got[name], tensor), name
    assert not all(torch.equal(got[k], numeric_states[6][k]) for k in numeric_states[6])  # nor the raw ones


def test_auto_without_a_stop_keeps_the_best_of_its_budget_which_max_steps_caps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    scripted(monkeypatch, [1.0, 1.5, 1.6, 1.9, 1.7])  # untrained, epochs 1..4: max_steps 12 ends the run there
    objective, head = tiny_objective()
    events = RunEvents(tmp_path)
    steps, metrics = run_training(
        objective, head, DATA, VAL, auto(max_steps=12, stop_patience=2), tmp_path, CPU, events
    )
    assert steps == 12 and metrics["kept_step"] == 9 and metrics[METRIC] == 1.9
    saved = {step: torch.load(tmp_path / f"step-{step:08d}.pt", weights_only=False)["model"] for step in (9, 12)}
    assert_weights(objective, saved[9])
    assert not all(torch.equal(saved[9][k], saved[12][k]) for k in saved[9])
    decision = [e["message"] for e in events.read() if "kept epoch" in e["message"]]
    assert decision == [
        f"trained to epoch 4 of at most 4 without a stop: best {METRIC} 1.900 at epoch 3; kept epoch 3 (step 9)"
    ]


def test_a_killed_auto_run_resumes_with_its_best_and_patience_and_keeps_the_same_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    scores = [1.0, 1.5, 1.8, 1.7, 1.75]  # patience 2: stops after epoch 4, keeps epoch 2
    scripted(monkeypatch, scores)
    objective, head = tiny_objective()
    straight_events = RunEvents(tmp_path / "straight")
    steps, metrics = run_training(
        objective, head, DATA, VAL, auto(stop_patience=2), tmp_path / "straight", CPU, straight_events
    )
    assert steps == 12 and metrics["kept_step"] == 6
    straight = trainable(objective)

    scripted(monkeypatch, scores)  # one script for the killed run and its resume: each validation made once
    monkeypatch.setenv(ENV, "training:steps=11")  # after epoch 3 (one validation without improvement) is saved
    objective, head = tiny_objective()
    events = RunEvents(tmp_path / "resumed")
    crashing = faulting_progress("training", ignore_progress)
    with pytest.raises(InjectedFault):
        run_training(
            objective, head, DATA, VAL, auto(stop_patience=2), tmp_path / "resumed", CPU, events, crashing, 0.0
        )
    monkeypatch.delenv(ENV)
    assert latest_state(tmp_path / "resumed").name == "step-00000009.pt"
    objective, head = tiny_objective()  # a fresh process; its trainable weights are not even the initial ones
    with torch.no_grad():
        for parameter in objective.parameters():
            if parameter.requires_grad:
                parameter.normal_()
    steps, resumed = run_training(objective, head, DATA, VAL, auto(stop_patience=2), tmp_path / "resumed", CPU, events)
    assert steps == 12 and events.count(RESUME, "training") == 1
    assert resumed == metrics
    for name, tensor in trainable(objective).items():
        assert torch.equal(tensor, straight[name]), name
    decision = [e["message"] for e in events.read() if "kept epoch" in e["message"]]
    assert decision == [e["message"] for e in straight_events.read() if "kept epoch" in e["message"]]


def test_numeric_epochs_validate_every_epoch_and_keep_training_and_metrics_as_before(tmp_path: Path) -> None:
    tc = TrainingConfig(epochs=2, checkpoint_every=100, lr=3e-3, batch_size=2)
    plain, head = tiny_objective()
    _, without = run_training(plain, head, DATA, None, tc, tmp_path / "plain", CPU, RunEvents(tmp_path))
    objective, head = tiny_objective()
    steps, metrics = run_training(objective, head, DATA, VAL, tc, tmp_path / "validated", CPU, RunEvents(tmp_path))
    assert steps == 6
    assert_weights(objective, trainable(plain))  # validating every epoch changes no step
    assert {k: v for k, v in metrics.items() if k in without} == without
    assert {k: v for k, v in metrics.items() if k.startswith("val_")} == validate(objective, head, VAL, 2, CPU, 1)
    assert not any(k.startswith("kept_") for k in metrics)
    state = torch.load(latest_state(tmp_path / "validated"), weights_only=False)
    assert [row["step"] for row in state["validations"]] == [3, 6]
    assert not list((tmp_path / "validated").glob("best-*.pt"))
