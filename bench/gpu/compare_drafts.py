"""Two trainings of one draft side by side (on the H200 pair: the flow's own `training.processes: auto` against
a hand-run `torchrun --nproc-per-node 2 eagle3 train` on the same HiddenStateSet and VocabMap): per exported
weight the largest absolute difference and the relative norm of the difference, and per logged step of both
`curves.jsonl` the training loss of each.

    python3 -m bench.gpu.compare_drafts RUN/draft RUN_HAND/draft
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from eagle3_core.run_layout import EXPORT
from eagle3_core.training.curves import RECORD_FILE, TRAIN, read_record

WEIGHTS = "model.safetensors"


def weight_differences(first: dict[str, torch.Tensor], second: dict[str, torch.Tensor]) -> dict[str, dict]:
    """name -> {max_abs, rel_norm} over the names both hold; a name only one holds is reported as missing."""
    differences: dict[str, dict] = {}
    for name in sorted(first.keys() | second.keys()):
        if name not in first or name not in second:
            differences[name] = {"missing_in": "first" if name not in first else "second"}
            continue
        a, b = first[name].double(), second[name].double()
        if a.shape != b.shape:
            differences[name] = {"shapes": [list(a.shape), list(b.shape)]}
            continue
        delta = a - b
        scale = a.norm().item() or 1.0
        differences[name] = {"max_abs": delta.abs().max().item(), "rel_norm": delta.norm().item() / scale}
    return differences


def train_losses(draft_dir: Path) -> dict[int, float]:
    """step -> training loss of the rows `curves.jsonl` logged."""
    return {row["step"]: row["loss"] for row in read_record(draft_dir / RECORD_FILE) if row["kind"] == TRAIN}


def compare(first: Path, second: Path) -> dict:
    weights = weight_differences(load_file(first / EXPORT / WEIGHTS), load_file(second / EXPORT / WEIGHTS))
    losses_a, losses_b = train_losses(first), train_losses(second)
    shared = sorted(losses_a.keys() & losses_b.keys())
    compared = [v for v in weights.values() if "rel_norm" in v]
    return {
        "weights": weights,
        "largest_rel_norm": max((v["rel_norm"] for v in compared), default=None),
        "identical_weights": len(compared) == len(weights) and all(v["max_abs"] == 0 for v in compared),
        "steps": [max(losses_a, default=None), max(losses_b, default=None)],
        "train_loss": {step: [losses_a[step], losses_b[step]] for step in shared},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("first", type=Path)
    parser.add_argument("second", type=Path)
    args = parser.parse_args()
    print(json.dumps(compare(args.first, args.second)))


if __name__ == "__main__":
    main()
