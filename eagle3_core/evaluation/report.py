"""The evaluation's human-readable output: a markdown report and a PNG plot in `eval/`, and the guard
that fails a run whose draft is not accepted.

Both measurements sit side by side everywhere: if the transformers loop (a) accepts and vLLM (b) does not,
the fault is in how the engine loads or feeds the draft; if both fail, it is the draft or its data.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from eagle3_core.evaluation.segments import SEGMENTS
from eagle3_core.evaluation.served import ENGINE_LABELS
from eagle3_core.evaluation.stats import AcceptanceStats
from eagle3_core.files import atomic_path, write_text_atomic

LIKELY_CAUSES = (
    "aux layer ids: the draft's `eagle_aux_hidden_state_layer_ids` must equal the ids the hidden states were "
    "extracted at (vLLM convention, = transformers output_hidden_states[i]); off by one feeds the draft "
    "states it never saw",
    "weight names: vLLM loads `fc`, `midlayer.*`, `norm`, `lm_head`, `d2t` without a `model.` prefix; a "
    "misnamed tensor stays at its random initialisation (look for 'not loaded' warnings in the server log)",
    "d2t offsets: target id = draft id + d2t[draft id]; absolute ids or a reversed map turn every proposal "
    "into a wrong token",
    "chat template: prompts rendered with another template (or none) at sampling, extraction or evaluation "
    "put the draft off the distribution it was trained on",
)


class AcceptanceBelowFloor(RuntimeError):
    """Position-0 acceptance below `evaluation.acceptance_floor`; the report was written before raising."""


def fmt(value: float | None, digits: int = 3) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def position0(acceptance: dict[str, Any] | None) -> float | None:
    """Position-0 acceptance rate of a serialised `AcceptanceStats`, or None."""
    if not acceptance or not acceptance.get("drafts"):
        return None
    return AcceptanceStats.from_json(acceptance).per_position[0]


def guard_message(
    hf_rate0: float | None, vllm_rate0: float | None, floor: float, layer_ids: dict[str, Any]
) -> str | None:
    """The failure text when a measured position-0 acceptance is below `floor`, else None."""
    low = [r for r in (hf_rate0, vllm_rate0) if r is not None and r < floor]
    if not low:
        return None
    lines = [
        f"position-0 acceptance below acceptance_floor={floor}: transformers (a) {fmt(hf_rate0)}, "
        f"vLLM (b) {fmt(vllm_rate0)}",
        "  " + ", ".join(f"{name}={ids}" for name, ids in layer_ids.items()),
    ]
    if len({json.dumps(ids) for ids in layer_ids.values()}) > 1:
        lines.append("  the layer ids differ: the draft reads other target layers than it was trained on")
    if hf_rate0 is not None and vllm_rate0 is not None and (hf_rate0 >= floor) != (vllm_rate0 >= floor):
        lines.append("  (a) and (b) disagree: the mismatch is engine-side (how vLLM loads or feeds the draft)")
    lines.append("likely causes:")
    lines += [f"  - {cause}" for cause in LIKELY_CAUSES]
    return "\n".join(lines)


def _rates(acceptance: dict[str, Any] | None) -> list[float]:
    return AcceptanceStats.from_json(acceptance).per_position if acceptance and acceptance["drafts"] else []


def _tau(acceptance: dict[str, Any] | None) -> float | None:
    return AcceptanceStats.from_json(acceptance).acceptance_length if acceptance and acceptance["drafts"] else None


def speedup_cell(speedup: float | None, tau: float | None) -> str:
    """A measured speedup, flagged when above τ: a step of speculative decoding emits at most τ tokens on
    average and costs at least one target pass, so a speedup above τ is timing noise (a busy machine during
    the plain run), never a property of the draft."""
    if speedup is None or tau is None or speedup <= tau:
        return fmt(speedup, 2)
    return f"{fmt(speedup, 2)} (noise: above τ)"


def slower_lines(summary: dict[str, Any]) -> list[str]:
    """One line per prompt set and mode where (b) measured the draft making serving slower (speedup < 1)."""
    lines = []
    for name in set_names(summary):
        for mode, label in (("batch1", "batch 1"), ("concurrent", "concurrency")):
            speedup = measured(summary, "vllm", name).get(mode, {}).get("speedup")
            if speedup is not None and speedup < 1:
                lines.append(f"- {name}, {label}: the draft makes serving slower ({fmt(speedup, 2)}× plain).")
    return ["", *lines] if lines else []


def agreement_cell(measured_b: dict[str, Any], identical_key: str = "identical_outputs") -> str:
    """(b)'s (or, with `identical_to_greedy`, (a)'s) outputs against plain greedy: identical count, then
    near-ties and defects where judged."""
    cell = measured_b.get(identical_key, "—")
    if "defects" not in measured_b:
        return cell
    defects = measured_b["defects"]
    named = f" ({', '.join(defects[:5])}{', …' if len(defects) > 5 else ''})" if defects else ""
    unrepeatable = measured_b.get("unrepeatable") or []
    plain = f"; plain greedy not repeatable {len(unrepeatable)}" if unrepeatable else ""
    if (flip := measured_b.get("plain_flip_gap")) is not None:
        plain += f", flipping at gaps ≤ {flip:g} (near-ties up to there)"
    return f"{cell}; near-ties {measured_b['near_ties']}; defects {len(defects)}{named}{plain}"


def lossless_note(measured_a: dict[str, Any]) -> list[str]:
    """Why (a)'s outputs differ from plain greedy where they do: near-ties (rounding), or defects."""
    pooled = (measured_a.get("sets") or {}).get("all") or next(iter((measured_a.get("sets") or {}).values()), {})
    near_ties, defects = pooled.get("near_ties", 0), pooled.get("defects", [])
    lines = []
    if near_ties:
        lines.append(
            f"(a) in {measured_a.get('dtype', '?')}: {near_ties} output(s) leave plain greedy at a near-tie (plain's "
            "top-2 logit gap below evaluation.near_tie_logit_gap there): verifying k+1 tokens in one pass rounds "
            "differently from one-token steps, the draft is not at fault. float32 (evaluation.dtype) compares exactly."
        )
    if defects:
        lines.append(
            f"(a): {len(defects)} output(s) leave plain greedy where it was no near-tie ({', '.join(defects[:5])}): "
            "the speculative decoding is not lossless; report it with this run's draft/export."
        )
    return ["", *lines] if lines else []


def guard_lines(summary: dict[str, Any]) -> list[str]:
    if not summary["guard"]:
        return [f"**Guard**: passed (position-0 acceptance ≥ {summary['floor']})"]
    return ["**Guard: FAILED**", "", "```", summary["guard"], "```"]


def set_names(summary: dict[str, Any]) -> list[str]:
    """Prompt sets measured by (a) or (b), in order, `all` last."""
    names = list((summary["transformers"].get("sets") or {}) | ((summary.get("vllm") or {}).get("sets") or {}))
    return sorted(names, key=lambda name: name == "all")


def served_label(summary: dict[str, Any]) -> str:
    """The engine that measured (b) (`engine` of its result; vLLM for results saved before there was a choice)."""
    return ENGINE_LABELS[(summary.get("vllm") or {}).get("engine", "vllm")]


def measured(summary: dict[str, Any], engine: str, name: str) -> dict[str, Any]:
    """One prompt set's result of `transformers` (a) or `vllm` (b); {} when not measured."""
    return ((summary.get(engine) or {}).get("sets") or {}).get(name, {})


def methods(summary: dict[str, Any]) -> str:
    """What (a) and (b) were, or why one of them was not run."""
    hf, served = summary["transformers"], summary.get("vllm") or {}
    a = (
        f"(a) not run ({hf['skipped']})"
        if hf.get("skipped")
        else f"(a) chain speculative decoding in transformers ({hf['dtype']}), run at k = {hf['k']}"
    )
    b = (
        f"(b) not run ({served['skipped']})"
        if served.get("skipped")
        else f"(b) {served_label(summary)}, served with the draft as its EAGLE-3 speculator at k = {summary['k']}"
    )
    return f"{a}; {b}."


def segment_lines(sets: dict[str, Any]) -> list[str]:
    """τ of (a) per prompt set and per segment of the answers (`segments.SEGMENTS`), where any was measured."""
    if not any(a.get("segments") for a in sets.values()):
        return []
    lines = ["", "## τ by segment, (a)", "", "A step counts in the segment of the text emitted before it.", "",
             "| prompt set | " + " | ".join(SEGMENTS) + " |", "|---|" + "---|" * len(SEGMENTS)]  # fmt: skip
    for name, a in sets.items():
        cells = [fmt((a.get("segments") or {}).get(s, {}).get("tau")) for s in SEGMENTS]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def markdown_report(summary: dict[str, Any]) -> str:
    """The report as markdown, from the evaluation summary (see `evaluate_draft`)."""
    hf, k, names = summary["transformers"], summary["k"], set_names(summary)
    lines = [
        f"# EAGLE-3 draft evaluation: {summary['draft']}",
        "",
        f"Target `{summary['target']}`; k = {k} draft tokens per step; greedy; "
        f"{summary['max_new_tokens']} new tokens per prompt. {methods(summary)}",
        "",
        *guard_lines(summary),
        "",
        "## Acceptance length τ (tokens per target step, bonus token included)",
        "",
        f"| prompt set | prompts | (a) τ at k={k} | (a) τ at k={hf['k']} | (b) {served_label(summary)} τ at k={k} | "
        "(b) speedup batch 1 | (b) speedup concurrent |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in names:
        a, b = measured(summary, "transformers", name), measured(summary, "vllm", name)
        lines.append(
            f"| {name} | {a.get('prompts', '—')} | {fmt(a['tau_by_k'][k - 1] if a else None)} | "
            f"{fmt(_tau(a.get('acceptance')))} | {fmt(tau_b := _tau(b.get('acceptance')))} | "
            f"{speedup_cell(b.get('batch1', {}).get('speedup'), tau_b)} | "
            f"{speedup_cell(b.get('concurrent', {}).get('speedup'), tau_b)} |"
        )
    lines += slower_lines(summary)
    lines += ["", "## Per-position acceptance (share of steps accepted up to and including position i)", ""]
    positions = max(hf["k"], k)
    lines += [
        "| prompt set | engine | " + " | ".join(f"pos {i}" for i in range(positions)) + " |",
        "|---|---|" + "---|" * positions,
    ]
    for name in names:
        for engine, label in (("transformers", "(a) transformers"), ("vllm", f"(b) {served_label(summary)}")):
            rates = _rates(measured(summary, engine, name).get("acceptance"))
            cells = [fmt(rates[i]) if i < len(rates) else "—" for i in range(positions)]
            lines.append(f"| {name} | {label} | " + " | ".join(cells) + " |")
    if hf.get("sets"):
        lines += [
            "",
            f"## τ by k, derived from (a) at k={hf['k']}",
            "",
            "τ(k) = 1 + Σ_{i<k} rate_i: a chain of k accepts the prefix a longer chain accepts, cut at k.",
            "",
            "| prompt set | " + " | ".join(f"k={j}" for j in range(1, hf["k"] + 1)) + " |",
            "|---|" + "---|" * hf["k"],
        ]
        lines += [f"| {n} | " + " | ".join(fmt(t) for t in a["tau_by_k"]) + " |" for n, a in hf["sets"].items()]
    lines += segment_lines(hf.get("sets") or {})
    lines += [
        "",
        "## Time",
        "",
        "| prompt set | (a) draft time share | (a) target time share | (a) tokens | (a) = greedy | "
        "(b) tok/s batch 1 draft / plain | (b) tok/s concurrent draft / plain | (b) draft = plain |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in names:
        a, b = measured(summary, "transformers", name), measured(summary, "vllm", name)
        rates = [b.get(mode, {}).get(who, {}).get("tokens_per_s") for mode in ("batch1", "concurrent")
                 for who in ("draft", "plain")]  # fmt: skip
        lines.append(
            f"| {name} | {fmt(a.get('draft_share'), 2)} | {fmt(a.get('target_share'), 2)} | "
            f"{a.get('tokens', '—')} | {agreement_cell(a, 'identical_to_greedy')} | {fmt(rates[0], 1)} / "
            f"{fmt(rates[1], 1)} | {fmt(rates[2], 1)} / {fmt(rates[3], 1)} | {agreement_cell(b)} |"
        )
    lines += lossless_note(summary.get("transformers") or {})
    for engine, label in (("transformers", "(a)"), ("vllm", "(b)")):
        if (summary.get(engine) or {}).get("skipped"):
            lines += ["", f"{label} not measured: {summary[engine]['skipped']}"]
    return "\n".join(lines) + "\n"


def plot_report(summary: dict[str, Any], path: Path) -> Path:
    """PNG: per-position acceptance of (a) and (b), and τ against k (derived from (a); (b) at its k)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hf, k, names, served = summary["transformers"], summary["k"], set_names(summary), served_label(summary)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / max(2 * len(names), 1)
    for index, name in enumerate(names):
        a, b = measured(summary, "transformers", name), measured(summary, "vllm", name)
        for offset, (label, rates) in enumerate((("(a)", _rates(a.get("acceptance"))),
                                                 (f"(b) {served}", _rates(b.get("acceptance"))))):  # fmt: skip
            if rates:
                xs = [i + (2 * index + offset) * width - 0.4 for i in range(len(rates))]
                left.bar(xs, rates, width, align="edge", label=f"{name} {label}")
        if a:
            right.plot(range(1, hf["k"] + 1), a["tau_by_k"], marker="o", label=f"{name} (a) derived")
        if (vllm_tau := _tau(b.get("acceptance"))) is not None:
            right.plot([k], [vllm_tau], marker="s", linestyle="none", label=f"{name} (b) {served}")
    left.set(title="Acceptance per draft position", xlabel="position", ylabel="rate", ylim=(0, 1))
    left.set_xticks(range(max(hf["k"], k)))
    right.set(title="Acceptance length τ by k", xlabel="k (draft tokens per step)", ylabel="τ")
    right.set_xticks(range(1, max(hf["k"], k) + 1))
    for axis in (left, right):
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)
    return path


def write_report(summary: dict[str, Any], eval_dir: Path) -> list[Path]:
    """Write `report.md` and `acceptance.png` atomically; returns both paths."""
    markdown = eval_dir / "report.md"
    write_text_atomic(markdown, markdown_report(summary))
    return [markdown, plot_report(summary, eval_dir / "acceptance.png")]
