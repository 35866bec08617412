"""Training curves: TensorBoard event files and a loss/accuracy PNG of a training run.

Under `<run_dir>/draft/`:
- `curves.jsonl`: the record, one JSON row per trained step (`"kind": "train"`: loss, loss and top-1
  per TTT position, the chain acceptance they imply, lr, grad norm, tokens/s) and per validation
  (`"kind": "validation"`: loss, top-1 and simulated acceptance per position, acceptance length);
- `tensorboard/`: the same scalars as event files (`tensorboard --logdir <run_dir>/draft/tensorboard`),
  tags `train/<name>` and `val/<name>`;
- `training_curves.png`: loss, top-1, acceptance, lr and grad norm against the step, drawn from the record
  when training ends.

A resumed run continues the record: on resume at step S the rows of steps after S (trained again now) are
dropped from `curves.jsonl`, and the event files are written again from the rows kept, into one new file,
so neither the plot nor TensorBoard shows a step twice. (Not TensorBoard's `purge_step`: it drops the steps
written before it in load order, and TensorBoard loads event files in the order of their names, whose
last field is a per-process counter: `...pid.10` loads before `...pid.9`.) A fresh start clears all three.

The loop reads nothing from the device here except at its reports: each step's gradient norm stays a
device tensor until `report`, which reads them all with one copy, right after the loop's own sync.
"""

from __future__ import annotations

import base64
import json
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from eagle3_core.files import write_bytes_atomic, write_text_atomic

RECORD_FILE = "curves.jsonl"
TENSORBOARD_DIR = "tensorboard"
PLOT_FILE = "training_curves.png"
TRAIN, VALIDATION = "train", "validation"
TAG_PREFIX = {TRAIN: "train", VALIDATION: "val"}
MAX_POINTS = 2000  # per line of the PNG


def train_row(step: int, lr: float, grad_norm: float, record: Sequence[float], tokens_per_s: float) -> dict:
    """The record's row of one step from its `step_record` values (loss, stats [K, 3] flattened: CE sum,
    top-1 agreements, scored tokens per position, tokens). `acceptance_k` is the product of the top-1 rates
    of positions 0..k: the chance that a chain of greedy draft tokens is accepted up to position k."""
    stats = record[1:-1]
    row: dict[str, Any] = {"kind": TRAIN, "step": step, "loss": record[0], "lr": lr, "grad_norm": grad_norm}
    row["tokens_per_s"] = tokens_per_s
    chain = 1.0
    for k in range(len(stats) // 3):
        scored = max(stats[3 * k + 2], 1.0)
        top1 = stats[3 * k + 1] / scored
        chain *= top1
        row.update({f"loss_{k}": stats[3 * k] / scored, f"top1_{k}": top1, f"acceptance_{k}": chain})
    return row


def validation_row(step: int, metrics: dict[str, float]) -> dict:
    """The record's row of a validation from `validate`'s metrics (`val_loss_0`, ... without `val_`)."""
    values = {k.removeprefix("val_"): v for k, v in metrics.items() if k != "val_tokens"}
    return {"kind": VALIDATION, "step": step, **values}


def read_record(path: Path) -> list[dict]:
    """The rows of `curves.jsonl`; a line cut short by a crash is skipped."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def kept_on_resume(row: dict, step: int) -> bool:
    """Whether a row survives a resume at `step`: steps up to it were trained, and validated where due,
    before the state was saved."""
    return row["step"] <= step


def read_grad_norm(norm: torch.Tensor) -> torch.Tensor:
    """A plain tensor of `clip_grad_norm_`'s result; under FSDP2 a DTensor, made whole by a collective (so
    every rank calls this, at the same report)."""
    from torch.distributed.tensor import DTensor

    return norm.full_tensor() if isinstance(norm, DTensor) else norm


class TrainingCurves:
    """The curves of one training run under `out_dir` (None: record nothing, as on ranks other than 0).

    The loop calls `start` once it knows its first step, `step` after each optimizer step (on every rank),
    `report` at each of its reports (on every rank), `validation` after each validation and `close` at
    the end (which draws the PNG)."""

    def __init__(self, out_dir: Path | None):
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self.writer = None
        self.norms: list[torch.Tensor] = []
        self.last_report = time.monotonic()

    @property
    def record_path(self) -> Path:
        return self.out_dir / RECORD_FILE

    @property
    def plot_path(self) -> Path:
        return self.out_dir / PLOT_FILE

    def start(self, step: int, history: Sequence[dict] = ()) -> None:
        """Begin at `step` (0: a fresh run, whose `initial_val_*` row of `history` is its first validation;
        otherwise a resume: rows after `step` are dropped)."""
        self.norms.clear()
        self.last_report = time.monotonic()
        if self.out_dir is None:
            return
        from torch.utils.tensorboard import SummaryWriter

        log_dir = self.out_dir / TENSORBOARD_DIR
        kept = [row for row in read_record(self.record_path) if kept_on_resume(row, step)] if step else []
        if not step:
            self.plot_path.unlink(missing_ok=True)
        write_text_atomic(self.record_path, "".join(json.dumps(row) + "\n" for row in kept))
        shutil.rmtree(log_dir, ignore_errors=True)
        self.writer = SummaryWriter(str(log_dir))
        self._write_events(kept)
        initial = {k.removeprefix("initial_"): v for row in history for k, v in row.items() if k.startswith("initial_")}
        if not step and initial:
            self.validation(0, initial)

    def step(self, grad_norm: torch.Tensor) -> None:
        """Keep a step's gradient norm (`clip_grad_norm_`'s result) as a device tensor until `report`."""
        self.norms.append(grad_norm.detach())

    def report(self, pending: Sequence[tuple], records: Sequence[Sequence[float]]) -> None:
        """Record the reported steps: `pending` (step, lr, ...) and their `step_record` values. Their grad
        norms are read here with one copy (the loop's own sync already waited for them)."""
        norms = [read_grad_norm(norm) for norm in self.norms]
        self.norms.clear()
        now, since = time.monotonic(), self.last_report
        self.last_report = now
        if self.out_dir is None or not records:
            return
        values = torch.stack(norms).double().tolist()
        tokens_per_s = sum(record[-1] for record in records) / max(now - since, 1e-9)
        rows = [
            train_row(step, lr, norm, record, tokens_per_s)
            for (step, lr, *_), norm, record in zip(pending, values, records, strict=True)
        ]
        self._append(rows)

    def validation(self, step: int, metrics: dict[str, float]) -> None:
        """Record a validation at `step` (`validate`'s metrics)."""
        if self.out_dir is not None:
            self._append([validation_row(step, metrics)])

    def close(self) -> None:
        """Close the event files and draw `training_curves.png` from the whole record."""
        if self.writer is None:
            return
        self.writer.close()
        self.writer = None
        rows = read_record(self.record_path)
        if rows:
            write_bytes_atomic(self.plot_path, curves_png(rows))

    def _append(self, rows: list[dict]) -> None:
        with open(self.record_path, "a") as record:
            record.write("".join(json.dumps(row) + "\n" for row in rows))
        self._write_events(rows)
        self.writer.flush()

    def _write_events(self, rows: list[dict]) -> None:
        for row in rows:
            prefix = TAG_PREFIX[row["kind"]]
            for name, value in row.items():
                if name not in ("kind", "step"):
                    self.writer.add_scalar(f"{prefix}/{name}", value, row["step"])


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing mean over `window` points (fewer at the start)."""
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def curves_png(rows: list[dict]) -> bytes:
    """Four panels against the step: loss (total and per position, validation as markers), top-1 and the
    chain acceptance per position (validation: simulated acceptance), lr and grad norm. Train curves are
    drawn raw (faint) and smoothed."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [row for row in rows if row["kind"] == TRAIN]
    val = [row for row in rows if row["kind"] == VALIDATION]
    positions = sorted({int(k.rsplit("_", 1)[1]) for row in train + val for k in row if k.startswith("top1_")})
    steps = [row["step"] for row in train]
    window = max(1, len(train) // 50)
    stride = max(1, len(train) // MAX_POINTS)  # long runs: every stride-th point drawn
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]

    def line(ax, name: str, color: str, label: str) -> None:
        if train and name in train[0]:
            values = [row[name] for row in train]
            ax.plot(steps[::stride], values[::stride], color=color, alpha=0.25, linewidth=0.8)
            ax.plot(steps[::stride], smooth(values, window)[::stride], color=color, linewidth=1.5, label=label)

    def markers(ax, name: str, color: str, label: str) -> None:
        points = [(row["step"], row[name]) for row in val if name in row]
        if points:
            ax.plot(*zip(*points, strict=True), "o--", color=color, markersize=5, linewidth=0.8, label=label)

    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5), dpi=80)
    (loss_ax, top1_ax), (accept_ax, lr_ax) = axes
    line(loss_ax, "loss", "black", "train loss (weighted)")
    for k in positions:
        color = colors[k % len(colors)]
        line(loss_ax, f"loss_{k}", color, f"train pos {k}")
        markers(loss_ax, f"loss_{k}", color, f"val pos {k}")
        line(top1_ax, f"top1_{k}", color, f"train pos {k}")
        markers(top1_ax, f"top1_{k}", color, f"val pos {k}")
        line(accept_ax, f"acceptance_{k}", color, f"train pos {k} (top-1 product)")
        markers(accept_ax, f"accept_rate_{k}", color, f"val pos {k} (simulated)")
    loss_ax.set(title="loss", ylabel="soft cross-entropy")
    top1_ax.set(title="top-1 agreement with the target", ylim=(0, 1))
    tau = [row["acceptance_length"] for row in val if "acceptance_length" in row]
    accept_ax.set(
        title="chain acceptance per position" + (f" (val acceptance length {tau[-1]:.2f})" if tau else ""),
        ylim=(0, 1),
        xlabel="step",
    )
    line(lr_ax, "lr", colors[0], "lr")
    lr_ax.set(title="lr and grad norm", xlabel="step", ylabel="lr")
    norm_ax = lr_ax.twinx()
    line(norm_ax, "grad_norm", colors[1], "grad norm")
    norm_ax.set_ylabel("grad norm (before clipping)")
    for ax in (loss_ax, top1_ax, accept_ax):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="best")
    (lr_lines, lr_labels), (norm_lines, norm_labels) = (ax.get_legend_handles_labels() for ax in (lr_ax, norm_ax))
    if lr_lines or norm_lines:
        norm_ax.legend(lr_lines + norm_lines, lr_labels + norm_labels, fontsize=7, loc="best")
    rates = sorted(row["tokens_per_s"] for row in train if "tokens_per_s" in row)
    if rates:
        fig.suptitle(f"{steps[-1]} steps, median {rates[len(rates) // 2]:,.0f} tokens/s", fontsize=10)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    return buffer.getvalue()


def embedded_png(path: Path, alt: str) -> str:
    """Markdown showing the PNG at `path` inline (a data URL: Prefect artifacts cannot link local files)."""
    return f"![{alt}](data:image/png;base64,{base64.b64encode(Path(path).read_bytes()).decode()})"


def curves_markdown(draft_dir: Path) -> str | None:
    """Markdown of a trained draft's curves (the PNG inline, where the event files are), or None."""
    draft_dir = Path(draft_dir)
    plot = draft_dir / PLOT_FILE
    if not plot.exists():
        return None
    return "\n".join(
        [
            embedded_png(plot, "training curves"),
            "",
            f"Plot: `{plot}`; scalars of every step: `{draft_dir / RECORD_FILE}`; "
            f"`tensorboard --logdir {draft_dir / TENSORBOARD_DIR}`",
        ]
    )
