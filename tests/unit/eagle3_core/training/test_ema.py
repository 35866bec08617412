"""The weight average of `training.ema_decay`: torch's EMA of the raw weights after every optimizer step,
in the module only while validation runs (raw weights back bit for bit) and, once training ends, for good:
the saved draft is the average, the training state keeps both."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from eagle3_core.config import TrainingConfig
from eagle3_core.events import RunEvents
from eagle3_core.training.ema import WeightAverage
from eagle3_core.training.loop import run_training, validate
from tests.helpers.training_data import CPU, synthetic_data, tiny_objective


def test_the_average_is_in_place_only_inside_applied() -> None:
    module = torch.nn.Linear(3, 2)
    module.bias.requires_grad_(False)  # frozen: not averaged
    ema = WeightAverage(module, 0.75)
    start = module.weight.detach().clone()
    with torch.no_grad():
        module.weight.add_(1.0)
    ema.update()
    raw = module.weight.detach().clone()
    assert ema.names == ["weight"] and torch.allclose(ema.average[0], start + 0.25)
    with ema.applied():
        assert torch.equal(module.weight, ema.average[0])
    assert torch.equal(module.weight, raw)


def test_the_saved_draft_is_the_average_of_the_steps_and_validation_runs_on_it(tmp_path: Path) -> None:
    data, val = synthetic_data(6), synthetic_data(2, seed=8)
    objective, head = tiny_objective()
    trained = [name for name, param in objective.named_parameters() if param.requires_grad]
    expected = {name: param.detach().clone() for name, param in objective.named_parameters() if param.requires_grad}
    tc = TrainingConfig(max_steps=4, checkpoint_every=1, keep_checkpoints=4, lr=3e-3, batch_size=2, ema_decay=0.5)
    _, metrics = run_training(objective, head, data, val, tc, tmp_path, CPU, RunEvents(tmp_path))
    for step in range(1, 5):  # the average of the initial weights and the raw weights after every step
        state = torch.load(tmp_path / f"step-{step:08d}.pt", weights_only=False)
        expected = {name: torch.lerp(expected[name], state["model"][name], 0.5) for name in trained}
        assert all(torch.allclose(state["ema"][name], expected[name], rtol=0, atol=1e-7) for name in trained)
    final = dict(objective.named_parameters())
    for name in trained:
        assert torch.equal(final[name], state["ema"][name]), name
        assert not torch.equal(final[name], state["model"][name]), name
    val_metrics = {name: value for name, value in metrics.items() if name.startswith("val_")}
    assert validate(objective, head, val, tc.batch_size, CPU, 1) == val_metrics  # measured on the average


def test_ema_is_refused_with_fsdp2() -> None:
    TrainingConfig(sharding="ddp", ema_decay=0.999)
    with pytest.raises(ValidationError, match="ema_decay"):
        TrainingConfig(sharding="fsdp2", optimizer="adamw", ema_decay=0.999)
