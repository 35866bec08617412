"""Training curves: TensorBoard event files and the loss/accuracy PNG of a real (tiny) training run, a
resumed run's continuous record, and the run summary showing the plot."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
import torch

from eagle3_core.artifacts import DraftCheckpoint
from eagle3_core.config import TrainingConfig
from eagle3_core.events import RunEvents
from eagle3_core.faults import ENV, InjectedFault, faulting_progress
from eagle3_core.progress import ProgressCallback, ignore_progress
from eagle3_core.training.curves import PLOT_FILE, RECORD_FILE, TENSORBOARD_DIR, TrainingCurves, read_record
from eagle3_core.training.loop import run_training
from flows.summary import PhaseRun, write_summary
from tests.helpers.training_data import CPU, synthetic_data, tiny_objective

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
STEPS = 8
VALIDATED = [0, 3, 6, STEPS]  # at the start, after each epoch of 3 steps and at the end


def scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag of the event files under `log_dir` as (step, value), read the way TensorBoard reads
    them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


def train(out_dir: Path, progress: ProgressCallback = ignore_progress) -> dict[str, float]:
    data = synthetic_data(6)
    objective, head = tiny_objective()
    tc = TrainingConfig(max_steps=STEPS, checkpoint_every=3, lr=3e-3, batch_size=2)
    _, metrics = run_training(
        objective,
        head,
        data,
        data[:2],
        tc,
        out_dir / "state",
        CPU,
        RunEvents(out_dir),
        progress,
        report_interval_s=0.0,
        curves=TrainingCurves(out_dir),
    )
    return metrics


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out_dir = tmp_path_factory.mktemp("straight")
    train(out_dir)
    return out_dir


def test_a_run_writes_event_files_a_record_and_a_png(straight: Path) -> None:
    tags = scalars(straight / TENSORBOARD_DIR)
    every_step = list(range(1, STEPS + 1))
    for name in ("loss", "lr", "grad_norm", "tokens_per_s", "loss_0", "loss_1", "top1_0", "top1_1"):
        assert [step for step, _ in tags[f"train/{name}"]] == every_step, name
    for name in ("loss_0", "top1_1", "accept_rate_0", "acceptance_length"):
        assert [step for step, _ in tags[f"val/{name}"]] == VALIDATED, name
    # The implied chain acceptance is the product of the per-position top-1 rates.
    for (_, top0), (_, top1), (_, chain) in zip(
        tags["train/top1_0"], tags["train/top1_1"], tags["train/acceptance_1"], strict=True
    ):
        assert chain == pytest.approx(top0 * top1, rel=1e-5)
    assert all(value > 0 and math.isfinite(value) for _, value in tags["train/grad_norm"])
    assert all(value > 0 for _, value in tags["train/tokens_per_s"])
    history = torch.load(straight / "state" / "step-00000008.pt", weights_only=False)["history"]
    lrs = {row["step"]: row["lr"] for row in history if "lr" in row}
    assert [value for _, value in tags["train/lr"]] == pytest.approx([lrs[s] for s in every_step], rel=1e-6)

    png = (straight / PLOT_FILE).read_bytes()
    assert png.startswith(PNG_MAGIC) and len(png) > 10_000
    from PIL import Image

    with Image.open(straight / PLOT_FILE) as image:
        image.verify()


def test_a_resumed_run_continues_the_record_without_repeating_steps(
    straight: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV, "training:steps=5")  # crashes at step 5's report: its row is lost with the process
    with pytest.raises(InjectedFault):
        train(tmp_path, faulting_progress("training", ignore_progress))
    monkeypatch.delenv(ENV)
    # Checkpoint at step 3; steps 4 and 5 are trained again after the resume.
    assert [row["step"] for row in read_record(tmp_path / RECORD_FILE) if row["kind"] == "train"] == [1, 2, 3, 4]
    with open(tmp_path / RECORD_FILE, "a") as record:
        record.write('{"kind": "train", "st')  # a line cut short by the crash
    assert not (tmp_path / PLOT_FILE).exists(), "drawn when training ends, which the crash never reached"
    train(tmp_path)

    rows = read_record(tmp_path / RECORD_FILE)
    # Step 3's validation came before its checkpoint, which the run resumed from: kept, not made again.
    made = [("validation", 0)] + [
        row
        for step in range(1, STEPS + 1)
        for row in [("train", step), ("validation", step)][: 1 + (step in VALIDATED)]
    ]
    assert [(row["kind"], row["step"]) for row in rows] == made
    tags = scalars(tmp_path / TENSORBOARD_DIR)
    assert [step for step, _ in tags["train/loss"]] == list(range(1, STEPS + 1))
    assert [step for step, _ in tags["val/loss_0"]] == VALIDATED
    # One event file: TensorBoard reads several in the order of their names, whose per-process counter
    # sorts `.10` before `.9`, so steps of an earlier file could land after the resumed ones.
    assert len(list((tmp_path / TENSORBOARD_DIR).glob("events.out.tfevents.*"))) == 1
    # The resumed run is bit for bit the uninterrupted one, and so is its record (but for the timing).
    expected = [{k: v for k, v in row.items() if k != "tokens_per_s"} for row in read_record(straight / RECORD_FILE)]
    assert [{k: v for k, v in row.items() if k != "tokens_per_s"} for row in rows] == expected
    assert (tmp_path / PLOT_FILE).read_bytes().startswith(PNG_MAGIC)


def test_a_fresh_start_clears_the_curves_of_an_earlier_run(straight: Path, tmp_path: Path) -> None:
    curves = TrainingCurves(tmp_path)
    curves.start(0)
    curves.validation(0, {"val_loss_0": 1.0, "val_tokens": 5.0})
    curves.close()
    curves = TrainingCurves(tmp_path)
    curves.start(0)
    curves.close()
    assert read_record(tmp_path / RECORD_FILE) == [] and not (tmp_path / PLOT_FILE).exists()
    assert scalars(tmp_path / TENSORBOARD_DIR) == {}


def test_the_run_summary_shows_the_training_curves(straight: Path, tmp_path: Path) -> None:
    checkpoint = DraftCheckpoint(root=str(straight), step=STEPS)
    phases = [PhaseRun(phase="training", state="Completed", seconds=1.0)]
    markdown, path = write_summary(tmp_path, time.time(), phases, None, checkpoint)
    assert "## Training curves" in markdown and "![training curves](data:image/png;base64," in markdown
    assert f"tensorboard --logdir {straight / TENSORBOARD_DIR}" in markdown
    assert path.read_text() == markdown
    # Without a plot (e.g. a checkpoint trained before curves existed) the section is left out.
    bare = DraftCheckpoint(root=str(tmp_path / "none"), step=STEPS)
    assert "Training curves" not in write_summary(tmp_path, time.time(), phases, None, bare)[0]
