"""How little training test_evaluation_vllm's SmolLM2 draft needs (issue 24): train it at other budgets from a
suite run's own `trained` fixture data, then measure (a) in transformers with the right and with the wrong aux
layer ids, as the module's tests do. The suite's assertions need position 0 above 0.05 and the wrong-ids draft
below half the right one's position 0 (the guard's floor).

    .venv/bin/python -m bench.suite_draft_budget <basetemp>/popen-gwN/trained0 --variant 1:3e-3 --variant 3:1e-3

`<basetemp>/popen-gwN/trained0` is the fixture's run folder of a suite run (its samples, hidden states and
vocabulary are reused; nothing is sampled or extracted again). A variant is `epochs:lr`; the first is the
baseline the others are compared with.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

from eagle3_core.artifacts import DraftCheckpoint, HiddenStateSet, SampleSet, TargetModel, VocabMap
from eagle3_core.config import TargetConfig
from eagle3_core.dtypes import host_cpu
from eagle3_core.evaluation.phase import evaluate_draft, export_dir
from eagle3_core.evaluation.report import AcceptanceBelowFloor
from eagle3_core.evaluation.speculative import torch_threads
from eagle3_core.events import RunEvents
from eagle3_core.target.prepare import prepare_target
from eagle3_core.training.phase import train_draft
from tests.integration.test_evaluation_vllm import pipeline_config

WRONG_IDS = [27, 28, 29]  # the wrong-ids test's


def wrong_ids_copy(checkpoint: DraftCheckpoint, folder: Path) -> DraftCheckpoint:
    """The export of `checkpoint` with its config naming WRONG_IDS, as the wrong-ids test writes it."""
    export = folder / "draft" / "export"
    shutil.copytree(export_dir(checkpoint), export)
    config = json.loads((export / "config.json").read_text())
    config["eagle_aux_hidden_state_layer_ids"] = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = WRONG_IDS
    (export / "config.json").write_text(json.dumps(config))
    return DraftCheckpoint(root=str(export.parent), layer_ids=checkpoint.layer_ids)


def measure(source: Path, work: Path, epochs: int, lr: float, target: TargetModel) -> dict[str, object]:
    """Train at `epochs` and `lr` on `source`'s data in `work`; (a) with the right and with the wrong ids."""
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    for name in ("samples", "hidden_states", "vocab"):
        (work / name).symlink_to(source / name)
    samples = SampleSet.load(source / "samples" / f"{SampleSet.kind}.json")
    states = HiddenStateSet.load(source / "hidden_states" / f"{HiddenStateSet.kind}.json")
    vocab = VocabMap.load(source / "vocab" / f"{VocabMap.kind}.json")
    config = pipeline_config(work)
    config.training.epochs, config.training.lr = epochs, lr
    start = time.perf_counter()
    with torch_threads(1):  # as the fixture trains
        checkpoint = train_draft(config, states, vocab, target, RunEvents(work))
    train_s = time.perf_counter() - start
    right_dir, wrong_dir = work / "right", work / "wrong"
    right = evaluate_draft(
        pipeline_config(right_dir, with_vllm=False, acceptance_floor=0.0), checkpoint, target, samples,
        RunEvents(right_dir),
    )  # fmt: skip
    floor = right.per_position[0] / 2
    wrong_config = pipeline_config(wrong_dir, with_vllm=False, acceptance_floor=floor)
    try:
        evaluate_draft(wrong_config, wrong_ids_copy(checkpoint, wrong_dir), target, samples, RunEvents(wrong_dir))
        tripped = False
    except AcceptanceBelowFloor:
        tripped = True
    wrong = json.loads((wrong_dir / "eval" / "eval_report.json").read_text())
    return {
        "epochs": epochs, "lr": lr, "train_s": round(train_s, 1), "tau": round(right.acceptance_length, 3),
        "position0": round(right.per_position[0], 3), "wrong_position0": round(wrong["per_position"][0], 3),
        "floor": round(floor, 3), "guard_tripped": tripped,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trained", type=Path, help="a suite run's test_evaluation_vllm `trained` run folder")
    parser.add_argument("--variant", action="append", required=True, help="epochs:lr; the first is the baseline")
    parser.add_argument("--work", type=Path, default=Path("/tmp/suite-draft-budget"))
    args = parser.parse_args()
    target = prepare_target(TargetConfig(), RunEvents(args.work / "prepare"))
    model, flags = host_cpu()
    vector = "avx512" if any(f.startswith("avx512") for f in flags) else "avx2" if "avx2" in flags else "neither"
    print(f"machine: {model}, {len(os.sched_getaffinity(0))} cores, {vector}")
    rows = []
    for i, variant in enumerate(args.variant):
        epochs, lr = variant.split(":")
        rows.append(measure(args.trained, args.work / f"v{i}", int(epochs), float(lr), target))
        row = rows[-1]
        row["train_s_x_baseline"] = round(row["train_s"] / rows[0]["train_s"], 3)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
