"""The report that ends a flow run: which phases ran and which came from cache, every full weight load of
this run (read from events.jsonl, the same lines tests count), the acceptance table and plot, where the
drafter is, and its training curves. Rendered once as markdown: a Prefect artifact in the UI, a file in the
run, text on the CLI."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from eagle3_core.artifacts import DraftCheckpoint, EvalReport
from eagle3_core.events import CACHE_HIT, WEIGHT_LOAD, RunEvents
from eagle3_core.run_layout import DraftLayout, RunLayout
from eagle3_core.training.curves import curves_markdown, embedded_png


class PhaseRun(BaseModel):
    phase: str = Field(description="Phase name.")
    state: str = Field(description="Prefect state name: Completed, Cached, Failed, Crashed.")
    seconds: float = Field(description="Wall time of the task call, cached lookups included.")
    message: str = Field("", description="The state's message (the error of a failed phase).")

    @property
    def cached(self) -> bool:
        return self.state == "Cached"


def run_events_since(run_dir: Path, started: float) -> list[dict[str, Any]]:
    return [e for e in RunEvents(run_dir).read() if e["ts"] >= started]


def acceptance_plot_png(report: EvalReport) -> bytes:
    """Bar chart of the acceptance rate per draft position."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    positions = list(range(1, len(report.per_position) + 1))
    fig, ax = plt.subplots(figsize=(4, 2.6), dpi=100)
    ax.bar(positions, report.per_position, color="#3b82f6")
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1)
    ax.set_xticks(positions)
    ax.set_title(f"acceptance length {report.acceptance_length:.2f} (k={report.num_speculative_tokens})")
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    return buffer.getvalue()


def measurement_rows(report: EvalReport) -> list[tuple[str, dict[str, Any], Any]]:
    """(engine/prompt set, acceptance dict, batch-1 speedup) for every set each engine measured."""
    rows = []
    for engine, measured in sorted(report.measurements.items()):
        sets = measured.get("sets", {}) if isinstance(measured, dict) else {}
        for name, result in sorted(sets.items()):
            if isinstance(result, dict) and "acceptance" in result:
                speedup = (result.get("batch1") or {}).get("speedup")
                rows.append((f"{engine} / {name}", result["acceptance"], speedup))
    return rows


def acceptance_table(report: EvalReport) -> list[str]:
    def rates(values: list[float]) -> str:
        return " / ".join(f"{r:.3f}" for r in values)

    def times(speedup: float | None) -> str:
        return f"{speedup:.2f}x" if speedup is not None else "n/a"

    lines = [
        "| measurement | acceptance length | per position | speedup (batch 1) |",
        "| --- | --- | --- | --- |",
        f"| report (k={report.num_speculative_tokens}) | {report.acceptance_length:.3f} "
        f"| {rates(report.per_position)} | {times(report.speedup)} |",
    ]
    for name, acceptance, speedup in measurement_rows(report):
        lines.append(
            f"| {name} (k={acceptance.get('k', '?')}) | {acceptance['acceptance_length']:.3f} "
            f"| {rates(acceptance.get('per_position', []))} | {times(speedup)} |"
        )
    return lines


def render_summary(
    run_dir: Path,
    started: float,
    phases: list[PhaseRun],
    report: EvalReport | None,
    checkpoint: DraftCheckpoint | None,
    plot_path: Path | None,
) -> str:
    events = run_events_since(run_dir, started)
    loads = [e for e in events if e["event"] == WEIGHT_LOAD]
    cached = [p.phase for p in phases if p.cached]
    lines = ["# EAGLE-3 drafter run", "", f"Run directory: `{Path(run_dir).resolve()}`", ""]
    lines += ["## Phases", "", "| phase | state | seconds |", "| --- | --- | --- |"]
    lines += [f"| {p.phase} | {p.state} | {p.seconds:.1f} |" for p in phases]
    failed = [p for p in phases if p.state not in ("Completed", "Cached")]
    lines += [""] + [f"**{p.phase} {p.state.lower()}:** {p.message}" for p in failed]
    lines += [f"Cached (not run again): {', '.join(cached) if cached else 'none'}.", ""]
    lines += [f"## Full weight loads this run: {len(loads)}", ""]
    lines += [f"- {e['phase']}: {e['message']}" for e in loads] or ["- none"]
    hits = [e for e in events if e["event"] == CACHE_HIT]
    lines += ["", f"Cache hits recorded in events.jsonl: {len(hits)}.", ""]
    if report is not None:
        lines += ["## Acceptance", "", *acceptance_table(report), ""]
        if plot_path is not None:
            lines += [embedded_png(plot_path, "acceptance per position"), ""]
            lines += [f"Plot: `{plot_path}`", ""]
    if checkpoint is not None:
        lines += ["## Drafter", "", f"Checkpoint (step {checkpoint.step}): `{checkpoint.root}`"]
        lines += [f"vLLM-loadable export: `{DraftLayout(checkpoint.root_path).export}`", ""]
        curves = curves_markdown(Path(checkpoint.root))
        if curves is not None:
            lines += ["## Training curves", "", curves, ""]
    return "\n".join(lines)


def write_summary(
    run_dir: Path,
    started: float,
    phases: list[PhaseRun],
    report: EvalReport | None,
    checkpoint: DraftCheckpoint | None,
) -> tuple[str, Path]:
    """Render the summary, save it (and the plot) under `<run_dir>/summary/`; return (markdown, path)."""
    layout = RunLayout(Path(run_dir))
    out_dir = layout.summary
    out_dir.mkdir(parents=True, exist_ok=True)
    plot_path = None
    if report is not None and report.per_position:
        plot_path = out_dir / "acceptance.png"
        plot_path.write_bytes(acceptance_plot_png(report))
    markdown = render_summary(run_dir, started, phases, report, checkpoint, plot_path)
    layout.summary_markdown.write_text(markdown)
    return markdown, layout.summary_markdown
