"""The training loop on synthetic packed sequences: it learns, a run stopped at step k and resumed ends
bit for bit where an uninterrupted run ends (with the training levers too), the levers change the training
steps and never validation, and the schedule helpers behave."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from eagle3_core.config import TrainingConfig
from eagle3_core.events import RESUME, RunEvents
from eagle3_core.faults import ENV, InjectedFault, faulting_progress
from eagle3_core.training.loop import compile_plan, lr_factor, report_due, run_training, split_validation
from eagle3_core.training.state import latest_state
from tests.helpers.training_data import CPU, synthetic_data, tiny_objective


def config(**overrides) -> TrainingConfig:
    return TrainingConfig(max_steps=8, checkpoint_every=3, lr=3e-3, batch_size=2, **overrides)


LEVERS = {"ema_decay": 0.9, "input_noise": 0.2, "loss_on_prompt": True}


@pytest.mark.parametrize("levers", [{}, LEVERS], ids=["default", "levers"])
def test_resumed_run_ends_bit_for_bit_where_uninterrupted_run_ends(tmp_path: Path, monkeypatch, levers) -> None:
    data = synthetic_data(6)
    events = RunEvents(tmp_path)
    objective, head = tiny_objective()
    steps, _ = run_training(objective, head, data, None, config(**levers), tmp_path / "straight", CPU, events)
    assert steps == 8
    straight = {k: v.clone() for k, v in objective.state_dict().items()}

    objective, head = tiny_objective()
    # The run fails after step 5, as a crash there would (the fault injection the phases use; every step reported).
    monkeypatch.setenv(ENV, "training:steps=5")
    updates = []
    crashing = faulting_progress("training", updates.append)
    with pytest.raises(InjectedFault):
        run_training(objective, head, data, None, config(**levers), tmp_path / "resumed", CPU, events, crashing, 0.0)
    monkeypatch.delenv(ENV)
    assert updates[-1].done == 5 and latest_state(tmp_path / "resumed").name == "step-00000003.pt"
    objective, head = tiny_objective()  # a fresh process; its trainable weights are not even the initial ones
    with torch.no_grad():
        for parameter in objective.parameters():
            if parameter.requires_grad:
                parameter.normal_()
    steps, _ = run_training(objective, head, data, None, config(**levers), tmp_path / "resumed", CPU, events)
    assert steps == 8 and events.count(RESUME, "training") == 1
    for name, tensor in objective.state_dict().items():
        assert torch.equal(tensor, straight[name]), name
    last = [torch.load(tmp_path / run / "step-00000008.pt", weights_only=False) for run in ("straight", "resumed")]
    for part in ("model", "ema"):  # the raw weights and their average (None without ema_decay)
        assert (last[0][part] is None) == (last[1][part] is None) == (part == "ema" and not levers)
        assert all(torch.equal(last[0][part][k], last[1][part][k]) for k in last[0][part] or {}), part
    assert sorted(p.name for p in (tmp_path / "resumed").glob("step-*.pt")) == ["step-00000006.pt", "step-00000008.pt"]


def test_training_lowers_loss_and_reports_validation(tmp_path: Path) -> None:
    data = synthetic_data(8)
    objective, head = tiny_objective()
    updates = []
    tc = TrainingConfig(max_steps=40, checkpoint_every=100, lr=1e-2, batch_size=2, warmup_ratio=0.1)
    steps, metrics = run_training(
        objective, head, data, data[:3], tc, tmp_path, CPU, RunEvents(tmp_path), updates.append
    )
    assert steps == 40 and len(updates) == 40
    assert updates[-1].done == 40 and updates[-1].rate > 0 and "loss" in updates[-1].message
    assert metrics["val_loss_0"] < metrics["initial_val_loss_0"]
    assert metrics["val_top1_0"] > metrics["initial_val_top1_0"]
    assert 1.0 <= metrics["val_acceptance_length"] <= 3.0
    assert 1.0 <= metrics["val_decode_acceptance_length"] <= 3.0
    assert metrics["val_decode_accept_rate_0"] >= metrics["val_decode_accept_rate_1"]


def test_lr_schedule_warms_up_then_decays_to_the_floor() -> None:
    factors = [lr_factor(s, 100, 0.1, 0.1) for s in range(100)]
    assert factors[0] == pytest.approx(0.1) and factors[9] == pytest.approx(1.0)
    assert factors[-1] == pytest.approx(0.1, abs=1e-3) and all(a >= b for a, b in itertools.pairwise(factors[9:]))


def test_validation_split_is_salted_against_the_evaluation_holdout() -> None:
    from eagle3_core.sampling.table import is_heldout

    ids = [f"p{i}" for i in range(2000)]
    extracted = [s for s in ids if not is_heldout(s, 0.1)]  # what extraction keeps
    train, val = split_validation(extracted, 0.05)
    assert 50 < len(val) < 150 and len(train) + len(val) == len(extracted)


def test_compile_plan_and_report_schedule() -> None:
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert [compile_plan(s, cuda) for s in ("auto", "on", "off")] == ["triton", "triton", None]
    assert [compile_plan(s, cpu) for s in ("auto", "on", "off")] == [None, "inductor", None]
    assert report_due(6, 8, 3, 0.0, 1.0) and report_due(8, 8, 100, 0.0, 1.0) and report_due(5, 8, 3, 1.5, 1.0)
    assert not report_due(5, 8, 3, 0.5, 1.0)


def test_compile_setting_stays_out_of_the_cache_key() -> None:
    from eagle3_core.config import PipelineConfig
    from eagle3_core.training.phase import phase_config

    keys = [phase_config(PipelineConfig(training={"compile": c})) for c in ("auto", "on", "off")]
    assert keys[0] == keys[1] == keys[2]


def test_history_is_the_same_whatever_the_report_interval(tmp_path: Path) -> None:
    """Rows made in batches at each report (one host sync) equal rows made every step."""
    data = synthetic_data(6)
    histories, messages = [], []
    for interval in (0.0, 1e9):
        objective, head = tiny_objective()
        updates = []
        tc = config()
        state_dir = tmp_path / str(interval)
        run_training(objective, head, data, None, tc, state_dir, CPU, RunEvents(tmp_path), updates.append, interval)
        histories.append(torch.load(latest_state(state_dir), weights_only=False)["history"])
        messages.append([(u.done, u.message) for u in updates])
    assert histories[0] == histories[1] and len(histories[0]) == 8
    assert messages[0] == messages[1] and [done for done, _ in messages[0]] == list(range(1, 9))


def test_validation_split_is_by_prompt_and_one_response_per_prompt_splits_as_before() -> None:
    prompts = [f"p{i}" for i in range(200)]
    samples = [(p if r == 0 else f"{p}#{r}", p) for p in prompts for r in range(3)]
    train, val = split_validation([s for s, _ in samples], 0.2, [p for _, p in samples])
    side = {s: s in val for s in train + val}
    by_prompt = {p: {side[s] for s, q in samples if q == p} for p in prompts}
    assert all(len(sides) == 1 for sides in by_prompt.values()), "every response of a prompt on one side"
    assert 20 < len(val) // 3 < 60
    assert split_validation(prompts, 0.2, prompts) == split_validation(prompts, 0.2)
    assert [p for p in prompts if p in val] == split_validation(prompts, 0.2)[1]


def short_run(tmp_path: Path, **levers) -> tuple[list[dict], dict[str, float]]:
    """(history, metrics) of 2 steps on 4 sequences, validated on 2 others, from the same initial draft."""
    objective, head = tiny_objective()
    tc = TrainingConfig(max_steps=2, checkpoint_every=2, batch_size=2, **levers)
    state_dir = tmp_path / "-".join(f"{k}={v}" for k, v in levers.items())
    _, metrics = run_training(
        objective, head, synthetic_data(4), synthetic_data(2, 8), tc, state_dir, CPU, RunEvents(tmp_path)
    )
    return torch.load(latest_state(state_dir), weights_only=False)["history"], metrics


def test_levers_change_the_training_loss_not_what_validation_counts(tmp_path: Path) -> None:
    """loss_on_prompt and input_noise change the training steps; validation of the same weights (the
    untrained draft's) is the same, over the same assistant tokens; the noise is the same for the same seed."""
    off = {"loss_on_prompt": False, "input_noise": 0.0}  # both on by default: each alone against neither
    base_history, base = short_run(tmp_path, **off)
    initial = {name: value for name, value in base.items() if name.startswith("initial_")}
    for levers in ({"loss_on_prompt": True}, {"input_noise": 0.2}):
        history, metrics = short_run(tmp_path, **{**off, **levers})
        assert history[1]["loss"] != base_history[1]["loss"], levers  # history[0]: the initial validation
        assert {name: metrics[name] for name in initial} == initial, levers
        assert metrics["val_tokens"] == base["val_tokens"], levers
    assert short_run(tmp_path / "again", input_noise=0.2)[0] == short_run(tmp_path, input_noise=0.2)[0]
