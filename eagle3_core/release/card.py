"""The export folder's model card, `README.md`: the Hub's YAML front matter (base model, library, tags), the
recipe and the data the draft was trained on, the acceptance its evaluation measured (engine, k, prompt sets,
date) once a report of this draft exists, and the commands that serve it in vLLM and SGLang. Written when
training exports the draft and again when its evaluation reports, so the folder can be published as is.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from eagle3_core.artifacts import DraftCheckpoint, EvalReport, SampleSet, TargetModel
from eagle3_core.config import SGLANG_IGNORED_FLAGS, ExportConfig, PipelineConfig
from eagle3_core.files import write_text_atomic
from eagle3_core.release.commands import KChoice, fastest_k, hub_commands
from eagle3_core.run_layout import RunLayout
from eagle3_core.target.reference import EMBEDDED, reference_of

CARD = "README.md"
# Embedded targets -> the Hub model they were converted from.
TAGS = ["eagle3", "speculative-decoding"]
RECIPE_FLAGS = ("norm_before_fc", "fc_norm", "norm_before_residual", "norm_output")
ENGINE_NAMES = {"vllm": "vLLM", "sglang": "SGLang"}


def base_model_id(target: TargetModel) -> str:
    """The target's Hub id: an embedded target's source model, a Hub target's repo, else config.json's
    `_name_or_path` where it names a Hub repo (`target.reference` reads it), else the folder's name."""
    if target.name in EMBEDDED:
        return EMBEDDED[target.name].hub_id
    if target.repo_id:
        return target.repo_id
    config = target.root_path / "config.json"
    name = json.loads(config.read_text()).get("_name_or_path", "") if config.is_file() else ""
    reference = reference_of(name) if name else None
    return reference.hub.repo_id if reference and reference.hub else target.name


def hub_link(model: str) -> str:
    """A Hub id as a link to its page; a plain name as is."""
    return f"[{model}](https://huggingface.co/{model})" if "/" in model else model


def front_matter(base_model: str) -> str:
    metadata = {"base_model": base_model, "library_name": "vllm", "tags": TAGS, "pipeline_tag": "text-generation"}
    return "---\n" + yaml.safe_dump(metadata, sort_keys=False) + "---\n"


def trained_with(config: PipelineConfig, checkpoint: DraftCheckpoint) -> tuple[dict[str, Any], list[str]]:
    """The `training.*` fields and `export.engines` the draft was trained with, as its checkpoint's key recorded
    them (engines at their default are left out of the key); the run's config for a checkpoint without one."""
    training = checkpoint.config.get("training") or config.training.model_dump(mode="json")
    engines = (checkpoint.config.get("export") or {}).get("engines")
    default = ExportConfig().engines if checkpoint.config.get("training") else config.export.engines
    return training, engines or default


def recipe_lines(config: PipelineConfig, draft: dict[str, Any], checkpoint: DraftCheckpoint) -> list[str]:
    """The draft's shape (its config.json) and how it was trained (`training.*`, steps, validation)."""
    tc, engines = trained_with(config, checkpoint)
    flags = [flag for flag in RECIPE_FLAGS if draft.get(flag)] or ["none"]
    validation = ", ".join(f"{name} {value:.3f}" for name, value in sorted(checkpoint.metrics.items())
                           if name.startswith("val_")) or "not validated"  # fmt: skip
    rows = [
        ("architecture", f"{draft['architectures'][0]}, 1 layer, hidden {draft['hidden_size']}, "
                         f"MLP {draft['intermediate_size']}"),
        ("draft vocabulary", f"{draft['draft_vocab_size']} of {draft['vocab_size']} target tokens"),
        ("aux layer ids", str(draft["eagle_aux_hidden_state_layer_ids"])),
        ("recipe flags", ", ".join(flags)),
        ("training", f"{tc['optimizer']}, lr {tc['lr']:g}, {tc['ttt_steps']} TTT steps, epochs {tc['epochs']}, "
                     f"{checkpoint.step} steps"),
        ("served by", ", ".join(ENGINE_NAMES[e] for e in engines) + " (export.engines)"),
        ("validation", validation),
    ]  # fmt: skip
    return ["## Recipe", "", "| | |", "|---|---|", *[f"| {name} | {value} |" for name, value in rows]]


def data_lines(config: PipelineConfig, sample_set: SampleSet | None) -> list[str]:
    """The prompt files, and what sampling made of them where its manifest is at hand."""
    names = ", ".join(Path(file).name for file in config.sampling.prompt_files)  # a path says where it ran: not public
    lines = ["## Data", "", f"- prompt files: {names}"]
    if sample_set is None:
        return [*lines, "- samples: the run's sample manifest is not at hand"]
    responses = sample_set.responses_per_prompt
    return [
        *lines,
        f"- samples: {sample_set.ok} answers of the target to {sample_set.prompts} prompts "
        f"({responses} response{'s' if responses != 1 else ''} per prompt), {sample_set.loss_tokens} tokens trained on",
    ]


def report_date(report: EvalReport) -> str:
    """The UTC date the report was written."""
    written = (report.root_path / f"{EvalReport.kind}.json").stat().st_mtime
    return datetime.fromtimestamp(written, UTC).date().isoformat()


def acceptance_lines(report: EvalReport | None) -> list[str]:
    """The report's headline: τ (tokens per target step) and position rates at its k, (a) and (b), and
    (b)'s batch-1 speedup; or that none was measured yet."""
    lines = ["## Acceptance", ""]
    if report is None:
        return [*lines, "Not measured yet: `eagle3 evaluate` writes it here."]
    evaluation = report.config.get("evaluation", {})
    served = report.measurements.get("vllm") or {}
    engine = "not run" if served.get("skipped") else ENGINE_NAMES[served.get("engine", "vllm")]
    k = report.num_speculative_tokens
    b = f"{report.vllm_acceptance_length:.3f}" if report.vllm_acceptance_length is not None else "—"
    speedup = f"{report.speedup:.2f}" if report.speedup is not None else "—"
    rates = " / ".join(f"{rate:.3f}" for rate in report.per_position)
    return [
        *lines,
        f"Measured {report_date(report)} at k = {k}, greedy, {evaluation.get('max_new_tokens', '—')} new tokens, "
        f"on the prompt sets {', '.join(evaluation.get('prompt_sets', []))} (held out from training).",
        "",
        "| k | τ (a) transformers | per position (a) | τ (b) served | (b) engine | (b) speedup batch 1 |",
        "|---|---|---|---|---|---|",
        f"| {k} | {report.acceptance_length:.3f} | {rates} | {b} | {engine} | {speedup} |",
    ]


def serve_lines(base_model: str, draft: str, choice: KChoice, draft_config: dict[str, Any]) -> list[str]:
    commands = hub_commands(base_model, draft, choice.k)
    unread = [flag for flag in SGLANG_IGNORED_FLAGS if draft_config.get(flag)]
    sglang_note = (
        [f"Trained with {', '.join(unread)}, which SGLang does not read: it would serve another layer than trained "
         "(lower acceptance, no error). Serve it with vLLM, or train with `export.engines: [vllm, sglang]`.", ""]
        if unread else []
    )  # fmt: skip
    return [
        "## Serve",
        "",
        f"{choice.reason}.",
        "",
        "vLLM:",
        "",
        "```bash",
        commands["vllm"],
        "```",
        "",
        "SGLang:",
        "",
        *sglang_note,
        "```bash",
        commands["sglang"],
        "```",
    ]


def model_card(
    config: PipelineConfig,
    target: TargetModel,
    checkpoint: DraftCheckpoint,
    export_dir: Path,
    sample_set: SampleSet | None,
    report: EvalReport | None,
    repo_id: str | None = None,
) -> str:
    """The card's text; the serve commands name the draft by `repo_id` where given, else by its folder."""
    base = base_model_id(target)
    draft = json.loads((export_dir / "config.json").read_text())
    lines = [
        f"# EAGLE-3 draft for {base}",
        "",
        f"A one-layer EAGLE-3 speculator for {hub_link(base)}, trained with eagle3-pipeline "
        "on the target's own answers and hidden states. Serve it beside the target: greedy outputs stay the "
        "target's, produced in fewer target steps.",
        "",
        *recipe_lines(config, draft, checkpoint),
        "",
        *data_lines(config, sample_set),
        "",
        *acceptance_lines(report),
        "",
        *serve_lines(base, repo_id or str(export_dir), fastest_k(report), draft),
    ]
    return front_matter(base) + "\n" + "\n".join(lines) + "\n"


def report_of(eval_dir: Path, checkpoint: DraftCheckpoint) -> EvalReport | None:
    """The run's evaluation report where it measured this very draft, else None."""
    report = EvalReport.load_valid(eval_dir)
    return report if report is not None and report.upstream.get("draft_checkpoint") == checkpoint.digest else None


def write_model_card(
    config: PipelineConfig,
    target: TargetModel,
    checkpoint: DraftCheckpoint,
    export_dir: Path,
    repo_id: str | None = None,
) -> Path:
    """Write (atomically) `README.md` into `export_dir`, with the run's sample manifest and the evaluation
    report of this draft where they exist."""
    layout = RunLayout.of(config)
    sample_set = SampleSet.load_valid(layout.samples)
    report = report_of(layout.eval, checkpoint)
    path = export_dir / CARD
    write_text_atomic(path, model_card(config, target, checkpoint, export_dir, sample_set, report, repo_id))
    return path
