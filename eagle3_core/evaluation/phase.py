"""Phase 6, evaluate: measure the exported draft on held-out prompts with the real target, in
transformers (a) and served in vLLM or SGLang (b, `evaluation.engine`), write `eval/report.md`,
`eval/acceptance.png` and the `EvalReport`.

Resumable: each measurement is saved (atomically) under a key over the config fields and upstream
digests it depends on, per prompt set for (a), so a crash in (b) does not repeat (a) and a re-run with
the same inputs is a cache hit. The guard runs last, after everything is written: a failing draft loses
no measurement, and a re-run fails again from the saved numbers without measuring anything.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eagle3_core.artifacts import DraftCheckpoint, EvalReport, SampleSet, TargetModel, record_files
from eagle3_core.config import VERDICT, VLLM, PipelineConfig
from eagle3_core.dtypes import resolved_config
from eagle3_core.evaluation.keyed_results import load_saved, save
from eagle3_core.evaluation.preflight import preflight_evaluation
from eagle3_core.evaluation.prompts import (
    EvalPrompt,
    check_no_overlap,
    holdout_prompts,
    humaneval_prompts,
    training_prompts,
)
from eagle3_core.evaluation.report import AcceptanceBelowFloor, guard_message, position0, write_report
from eagle3_core.evaluation.stats import AcceptanceStats
from eagle3_core.events import CACHE_HIT, DECISION, RESUME, RunEvents
from eagle3_core.files import sha256_json
from eagle3_core.phases import EVALUATION, keyed_fields, phase_key
from eagle3_core.progress import ProgressCallback, ProgressUpdate, ignore_progress
from eagle3_core.release.card import write_model_card
from eagle3_core.run_layout import DraftLayout, RunLayout

PHASE = EVALUATION.name


def export_dir(checkpoint: DraftCheckpoint) -> Path:
    """The vLLM-loadable folder of a checkpoint: `<root>/export/` (or the root itself if it is one)."""
    for folder in (DraftLayout(checkpoint.root_path).export, checkpoint.root_path):
        if (folder / "config.json").is_file() and (folder / "model.safetensors").is_file():
            return folder
    raise FileNotFoundError(f"{checkpoint.root}: no exported draft (export/config.json + model.safetensors)")


def collect_prompts(config: PipelineConfig, sample_set: SampleSet | None) -> dict[str, list[EvalPrompt]]:
    """The configured held-out prompt sets, after checking that no held-out prompt was trained on."""
    evaluation, fraction = config.evaluation, config.sampling.holdout_fraction
    sets: dict[str, list[EvalPrompt]] = {}
    for name in evaluation.prompt_sets:
        if name == "humaneval":
            sets[name] = humaneval_prompts(evaluation.max_prompts)
        elif sample_set is not None:
            sets[name] = holdout_prompts(sample_set, fraction, evaluation.max_prompts, name)
    sets = {name: prompts for name, prompts in sets.items() if prompts}
    if not sets:
        raise ValueError(f"no held-out prompts: prompt_sets={evaluation.prompt_sets}, holdout_fraction={fraction}")
    if sample_set is not None:  # every held-out row, not only those measured: the split itself must be clean
        heldout = holdout_prompts(sample_set, fraction) + sets.get("humaneval", [])
        check_no_overlap(heldout, training_prompts(sample_set, fraction))
    return sets


def measurement_keys(
    config: PipelineConfig, upstream: dict[str, str], prompts: dict[str, list[EvalPrompt]]
) -> tuple[str, str]:
    """Digests of what (a) and (b) depend on: (a) the fields marked content for evaluation and the prompts,
    (b) those and the fields marked vllm, so (a) is reused when only vLLM's settings change. Neither holds
    a verdict field: a new floor re-judges saved numbers."""
    measured = {name: [p.id for p in ps] for name, ps in prompts.items()}
    key_a = sha256_json({**phase_key(config, EVALUATION), "prompts": measured, "upstream": upstream})
    return key_a, sha256_json({"transformers": key_a, **keyed_fields(config, PHASE, (VLLM,))})


def run_transformers(
    config: PipelineConfig,
    target: TargetModel,
    draft_dir: Path,
    prompts: dict[str, list[EvalPrompt]],
    key: str,
    eval_dir: Path,
    events: RunEvents,
    progress: ProgressCallback,
) -> dict[str, Any]:
    """Measurement (a) per prompt set (saved as each set finishes) plus the pooled `all`."""
    from eagle3_core.evaluation.speculative import pool_prompt_sets, torch_threads

    evaluation = config.evaluation
    k = max(evaluation.num_speculative_tokens, evaluation.sweep_max_k)
    if not evaluation.with_transformers:
        events.record(PHASE, DECISION, "measurement (a) skipped: evaluation.with_transformers is false")
        return {"k": k, "dtype": evaluation.dtype, "sets": {}, "skipped": "evaluation.with_transformers is false"}
    sets: dict[str, dict[str, Any]] = {}
    for name in prompts:
        if (saved := load_saved(eval_dir / f"transformers-{name}.json", key)) is not None:
            events.record(PHASE, RESUME, f"measurement (a) on {name} already done", prompt_set=name)
            sets[name] = saved
    todo = [name for name in prompts if name not in sets]
    if todo:
        with torch_threads(evaluation.cpu_threads):
            measure_sets(config, target, draft_dir, prompts, todo, k, key, eval_dir, events, progress, sets)
    if len(sets) > 1:
        sets["all"] = pool_prompt_sets(sets)
    return {"k": k, "dtype": evaluation.dtype, "sets": sets}


def measure_sets(
    config: PipelineConfig,
    target: TargetModel,
    draft_dir: Path,
    prompts: dict[str, list[EvalPrompt]],
    todo: list[str],
    k: int,
    key: str,
    eval_dir: Path,
    events: RunEvents,
    progress: ProgressCallback,
    sets: dict[str, dict[str, Any]],
) -> None:
    """Load the models once and measure every set in `todo` into `sets`, saving each as it finishes."""
    from eagle3_core.evaluation.speculative import measure_prompt_set

    evaluation = config.evaluation
    model, tokenizer, draft = load_models(config, target, draft_dir, events)
    for name in todo:

        def report(done: int, name: str = name) -> None:
            stage = f"(a) transformers, {name}"
            progress(ProgressUpdate(phase=PHASE, stage=stage, done=done, total=len(prompts[name]), unit="prompts"))

        sets[name] = measure_prompt_set(
            model, tokenizer, draft, prompts[name], k, evaluation.max_new_tokens,
            (evaluation.lossless_check_prompts, evaluation.near_tie_logit_gap), report,
        )  # fmt: skip
        save(eval_dir / f"transformers-{name}.json", key, sets[name])


def load_models(config: PipelineConfig, target: TargetModel, draft_dir: Path, events: RunEvents):
    """The target (a full weight load, recorded), its tokenizer, and the exported draft on one device."""
    from transformers import AutoTokenizer

    from eagle3_core.draft.export import load_exported
    from eagle3_core.evaluation.speculative import load_target, resolve_device

    device = resolve_device(config.evaluation.device)
    with events.weight_load(PHASE, f"{target.name} (transformers, {config.evaluation.dtype}, {device})"):
        model = load_target(target.root_path, config.evaluation.dtype, device)
    draft = load_exported(draft_dir, target.root_path).to(device).eval()
    return model, AutoTokenizer.from_pretrained(target.root_path), draft


def served_unavailable(config: PipelineConfig) -> str | None:
    """Why measurement (b) cannot run here in `evaluation.engine`, or None."""
    import importlib.util

    from eagle3_core.evaluation.sglang_measure import sglang_launch, sglang_unavailable

    if not config.evaluation.with_vllm:
        return "evaluation.with_vllm is false"
    if config.server.engine != "vllm":
        return "server.engine is external: a server that this phase cannot restart with the draft"
    if config.evaluation.engine == "sglang":
        return sglang_unavailable(sglang_launch(config.evaluation))
    if importlib.util.find_spec("vllm") is None:
        return "vllm is not installed"
    return None


def run_served(
    config: PipelineConfig,
    target: TargetModel,
    draft_dir: Path,
    prompts: dict[str, list[EvalPrompt]],
    key: str,
    eval_dir: Path,
    events: RunEvents,
    progress: ProgressCallback,
) -> dict[str, Any]:
    """Measurement (b) in `evaluation.engine` (saved as `vllm.json` whichever engine, its `engine` saying
    which), or why it was skipped."""
    from eagle3_core.evaluation.served import Measurement
    from eagle3_core.evaluation.sglang_measure import measure_sglang
    from eagle3_core.evaluation.vllm_measure import measure_vllm

    if (reason := served_unavailable(config)) is not None:
        events.record(PHASE, DECISION, f"measurement (b) skipped: {reason}")
        return {"skipped": reason}
    path = eval_dir / "vllm.json"
    if (saved := load_saved(path, key)) is not None:
        events.record(PHASE, RESUME, "measurement (b) already done")
        return saved
    measure = measure_sglang if config.evaluation.engine == "sglang" else measure_vllm
    with_draft = (eval_dir / "served-with-draft.json", key)  # a cut after the first server resumes past it
    result = measure(Measurement(config, target.root_path, draft_dir, prompts, events, progress, with_draft))
    save(path, key, result)
    return result


def pooled(measurement: dict[str, Any]) -> AcceptanceStats | None:
    """Acceptance of a measurement over all its prompt sets, at the k it ran with; None if not measured."""
    sets = measurement.get("sets") or {}
    result = sets.get("all") or next(iter(sets.values()), None)
    return AcceptanceStats.from_json(result["acceptance"]) if result else None


def headline(measurement: dict[str, Any], k: int) -> AcceptanceStats | None:
    """Pooled acceptance of a measurement, cut to the configured k (see `AcceptanceStats.tau_for_k`)."""
    stats = pooled(measurement)
    return stats.truncated(k) if stats else None


def evaluate_draft(
    config: PipelineConfig,
    checkpoint: DraftCheckpoint,
    target: TargetModel,
    sample_set: SampleSet | None,
    events: RunEvents,
    progress: ProgressCallback = ignore_progress,
) -> EvalReport:
    """Measure, report, then guard: raises `AcceptanceBelowFloor` (after writing everything) when the
    pooled position-0 acceptance of (a) or (b) is below `evaluation.acceptance_floor`.
    `sample_set` None measures HumanEval only (no project prompts, nothing to check overlap against)."""
    config = resolved_config(config)  # `auto` dtypes as this host runs them, in keys and in the report
    eval_dir = RunLayout.of(config).eval
    draft_dir = export_dir(checkpoint)
    upstream = {"draft_checkpoint": checkpoint.digest, "target_model": target.digest}
    if sample_set is not None:
        upstream["sample_set"] = sample_set.digest
    prompts = collect_prompts(config, sample_set)
    key_a, key = measurement_keys(config, upstream, prompts)
    existing = cached_report(eval_dir, key, verdict_fields(config))
    if existing is not None:
        events.record(PHASE, CACHE_HIT, f"evaluation of {draft_dir} already done", path=str(eval_dir))
        write_model_card(config, target, checkpoint, draft_dir)
        return guard(existing)
    serving = config.evaluation.engine if served_unavailable(config) is None else None
    preflight_evaluation(target, draft_dir, serving, config.server, events)
    transformers = run_transformers(config, target, draft_dir, prompts, key_a, eval_dir, events, progress)
    vllm = run_served(config, target, draft_dir, prompts, key, eval_dir, events, progress)
    report = build_report(config, target, draft_dir, transformers, vllm, checkpoint, eval_dir, key, upstream)
    report.save()
    write_model_card(config, target, checkpoint, draft_dir)  # the card states what was measured
    return guard(report)


def build_report(
    config: PipelineConfig,
    target: TargetModel,
    draft_dir: Path,
    transformers: dict[str, Any],
    vllm: dict[str, Any],
    checkpoint: DraftCheckpoint,
    eval_dir: Path,
    key: str,
    upstream: dict[str, str],
) -> EvalReport:
    from eagle3_core.draft.export import read_draft_config

    evaluation, k = config.evaluation, config.evaluation.num_speculative_tokens
    hf_stats, vllm_stats = headline(transformers, k), headline(vllm, k)
    draft_ids = read_draft_config(draft_dir).get("eagle_aux_hidden_state_layer_ids")
    failure = guard_message(
        position0(hf_stats.to_json() if hf_stats else None),
        position0(vllm_stats.to_json() if vllm_stats else None),
        evaluation.acceptance_floor,
        {"draft config layer ids": draft_ids, "checkpoint layer ids": checkpoint.layer_ids},
    )
    summary = {
        "draft": str(draft_dir), "target": target.name, "k": k, "max_new_tokens": evaluation.max_new_tokens,
        "floor": evaluation.acceptance_floor, "guard": failure, "transformers": transformers, "vllm": vllm,
    }  # fmt: skip
    paths = write_report(summary, eval_dir)
    measurement_files = sorted(eval_dir.glob("transformers-*.json")) + sorted(eval_dir.glob("vllm.json"))
    vllm_all = (vllm.get("sets") or {}).get("all", {})
    return EvalReport(
        root=str(eval_dir),
        files=record_files(eval_dir, paths + measurement_files),
        config={"key": key, "verdict": verdict_fields(config), "evaluation": evaluation.model_dump(mode="json")},
        upstream=upstream,
        num_speculative_tokens=k,
        acceptance_length=(hf_stats or vllm_stats or AcceptanceStats(k)).acceptance_length,
        per_position=(hf_stats or vllm_stats or AcceptanceStats(k)).per_position,
        speedup=vllm_all.get("batch1", {}).get("speedup"),
        tau_by_k=hf_all.tau_by_k() if (hf_all := pooled(transformers)) else [],
        vllm_acceptance_length=vllm_stats.acceptance_length if vllm_stats else None,
        vllm_per_position=vllm_stats.per_position if vllm_stats else [],
        guard_failure=failure,
        measurements={"transformers": transformers, "vllm": vllm},
    )


def verdict_fields(config: PipelineConfig) -> dict[str, Any]:
    """The fields that judge saved measurements (the acceptance floor), as marked on the fields."""
    return keyed_fields(config, PHASE, (VERDICT,))


def cached_report(eval_dir: Path, key: str, verdict: dict[str, Any]) -> EvalReport | None:
    """The saved report of the same inputs and verdict fields with all its files intact, or None."""
    report = EvalReport.load_valid(eval_dir)
    if report is None:
        return None
    return report if report.config.get("key") == key and report.config.get("verdict") == verdict else None


def guard(report: EvalReport) -> EvalReport:
    if report.guard_failure:
        raise AcceptanceBelowFloor(f"{report.guard_failure}\nreport: {report.root_path / 'report.md'}")
    return report


def checkpoint_of(folder: Path) -> DraftCheckpoint:
    """The DraftCheckpoint of a training run's draft folder, or one describing a bare export folder
    (config.json + model.safetensors written by `export_draft` or by another tool), its config read whole
    (a field it lacks is refused here, before any weight loads)."""
    from eagle3_core.draft.export import exported_config

    folder = Path(folder)
    if (folder / f"{DraftCheckpoint.kind}.json").is_file():
        return DraftCheckpoint.load(folder)
    paths = [folder / "config.json", folder / "model.safetensors"]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"{folder}: neither a draft checkpoint nor an export folder (missing {missing})")
    layer_ids = list(exported_config(folder).aux_layer_ids)
    return DraftCheckpoint(root=str(folder.resolve()), files=record_files(folder, paths), layer_ids=layer_ids)
