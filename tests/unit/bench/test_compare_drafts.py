"""bench/gpu/compare_drafts.py: what the H200 pair's comparison of the flow's multi-GPU training with a hand-run
torchrun reports, on two exported drafts written here."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from bench.gpu.compare_drafts import compare
from eagle3_core.training.curves import train_row


def write_draft(root: Path, weights: dict[str, torch.Tensor], losses: list[float]) -> Path:
    (root / "export").mkdir(parents=True)
    save_file(weights, str(root / "export" / "model.safetensors"))
    rows = [train_row(step, 1e-4, 1.0, [loss, 1.0, 1.0, 2.0, 2.0], 100.0) for step, loss in enumerate(losses, 1)]
    (root / "curves.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return root


def test_equal_drafts_are_identical_and_a_changed_weight_is_measured(tmp_path):
    fc = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    first = write_draft(tmp_path / "flow", {"fc.weight": fc, "d2t": torch.zeros(3)}, [5.0, 4.0])
    same = write_draft(tmp_path / "hand", {"fc.weight": fc.clone(), "d2t": torch.zeros(3)}, [5.0, 4.0])
    result = compare(first, same)
    assert result["identical_weights"] and result["largest_rel_norm"] == 0.0
    assert result["steps"] == [2, 2] and result["train_loss"] == {1: [5.0, 5.0], 2: [4.0, 4.0]}

    moved = fc.clone()
    moved[0, 1] += 0.5
    other = write_draft(tmp_path / "other", {"fc.weight": moved, "t2d": torch.zeros(3)}, [5.0, 3.5, 3.0])
    result = compare(first, other)
    assert not result["identical_weights"]
    assert result["weights"]["fc.weight"]["max_abs"] == 0.5
    assert abs(result["largest_rel_norm"] - 0.5 / fc.norm().item()) < 1e-9
    assert result["weights"]["d2t"] == {"missing_in": "second"} and result["weights"]["t2d"] == {"missing_in": "first"}
    assert result["steps"] == [2, 3] and result["train_loss"][2] == [4.0, 3.5]
