"""The `nightly-regenerate` flow: new prompts or a new target revision, in the SAME run directory.

Sampling and extraction resume by id, so only new prompts are sampled and only new samples extracted; the
draft is trained from the current one (`training.warm_start`), evaluated, and kept as `current` only if its
acceptance length beats the current drafter's. `current` is a symlink to a copied folder under `current.d/`
(not into `draft/`, which the next training overwrites) holding the exported drafter, its manifests and
`current.json`. Promotion is crash-safe: the new copy is complete before `current` is repointed with one
atomic rename (`os.replace` of a symlink), so a kill at any moment leaves `current` naming the old drafter or
the new one, never none; a `current` left missing by the copied folders of earlier versions is restored.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from prefect import flow
from prefect.artifacts import create_markdown_artifact
from pydantic import BaseModel, Field

from eagle3_core.artifacts import DraftCheckpoint, EvalReport
from eagle3_core.config import PipelineConfig
from eagle3_core.events import DECISION, RunEvents
from eagle3_core.files import write_text_atomic
from eagle3_core.hosts import host_slice
from eagle3_core.run_layout import DraftLayout, PromotedLayout, RunLayout
from eagle3_core.run_lock import run_dir_lock
from flows.hooks import stop_engines
from flows.train_drafter import run_pipeline

PHASE = "regenerate"


class CurrentDrafter(BaseModel):
    """`<run_dir>/current/current.json`: which drafter is current and why."""

    acceptance_length: float = Field(description="Acceptance length measured when it was promoted.")
    checkpoint_digest: str = Field(description="Digest of the promoted DraftCheckpoint.")
    eval_report_digest: str = Field(description="Digest of the EvalReport that promoted it.")
    promoted_at: float = Field(description="Unix time of the promotion.")


def load_current(config: PipelineConfig) -> CurrentDrafter | None:
    current = recovered_current(RunLayout.of(config).current)
    path = current.record
    return CurrentDrafter.model_validate_json(path.read_text()) if path.exists() else None


def recovered_current(current: PromotedLayout) -> PromotedLayout:
    """`current`, pointed back at the newest complete copy (one holding `current.json`: of `versions`, or
    the `current.old` an earlier version's promotion retired) where a crash left it missing."""
    if current.root.exists() or (current.root.is_symlink() and current.record.exists()):
        return current
    retired = current.root.with_name(current.root.name + ".old")
    copies = [*(p for p in current.versions.glob("*") if p.is_dir()), retired]
    complete = [p for p in copies if (p / current.record.name).is_file()]
    if complete:
        newest = max(complete, key=lambda p: (p / current.record.name).stat().st_mtime)
        if newest == retired:
            current.versions.mkdir(parents=True, exist_ok=True)
            retired.rename(current.versions / "retired")
            newest = current.versions / "retired"
        point_current(current, newest)
    return current


def point_current(current: PromotedLayout, copy: Path) -> None:
    """Point the `current` symlink at `copy` with one atomic rename. A `current` that is a copied folder (an
    earlier version's promotion) is first moved under `versions`."""
    current.versions.mkdir(parents=True, exist_ok=True)
    link = current.root.with_name(current.root.name + ".link")
    link.unlink(missing_ok=True)
    link.symlink_to(os.path.relpath(copy, current.root.parent))
    if current.root.is_dir() and not current.root.is_symlink():
        current.root.rename(current.versions / f"folder-{time.time_ns()}")
    os.replace(link, current.root)


def warm_start_config(config: PipelineConfig) -> PipelineConfig:
    """The config with training warm-started from `current`'s exported drafter, when there is one."""
    if load_current(config) is None or config.training.warm_start is not None:
        return config
    exported = RunLayout.of(config).current.draft.export
    training = config.training.model_copy(update={"warm_start": str(exported)})
    return config.model_copy(update={"training": training})


def is_better(report: EvalReport, current: CurrentDrafter | None) -> bool:
    return current is None or report.acceptance_length > current.acceptance_length


def promote(config: PipelineConfig, checkpoint: DraftCheckpoint, report: EvalReport) -> Path:
    """Copy the exported drafter, its checkpoint manifest and its report to a new folder of `current.d/` (not
    the training state: it is only for resuming, and large), point `current` at it (see the module
    docstring), then drop the copies older than the one it replaced."""
    current = recovered_current(RunLayout.of(config).current)
    name = f"{time.time_ns()}-{checkpoint.digest[:12]}"
    staging = current.version(name + ".partial")
    shutil.rmtree(staging.root, ignore_errors=True)
    draft = DraftLayout(checkpoint.root_path)
    shutil.copytree(draft.export, staging.draft.export)
    shutil.copy2(draft.root / f"{DraftCheckpoint.kind}.json", staging.draft.root)
    report.save(staging.root / f"{EvalReport.kind}.json")
    record = CurrentDrafter(
        acceptance_length=report.acceptance_length,
        checkpoint_digest=checkpoint.digest,
        eval_report_digest=report.digest,
        promoted_at=time.time(),
    )
    write_text_atomic(staging.record, record.model_dump_json(indent=2))
    promoted = current.version(name)
    staging.root.rename(promoted.root)
    previous = current.root.resolve() if current.root.is_symlink() else None
    point_current(current, promoted.root)
    for old in current.versions.iterdir():
        if old.resolve() not in (promoted.root.resolve(), previous):
            shutil.rmtree(old, ignore_errors=True)
    return current.root


@flow(
    name="nightly-regenerate",
    description="Sample new prompts, extract new samples, warm-start training, keep the better drafter.",
    on_cancellation=[stop_engines],
    on_crashed=[stop_engines],
)
def regenerate(config: PipelineConfig) -> EvalReport:
    with run_dir_lock(config.run_dir, host_slice(config)):  # one writer of the run folder, promote included
        return regenerate_holding_the_run_dir(config)


def regenerate_holding_the_run_dir(config: PipelineConfig) -> EvalReport:
    events = RunEvents(config.run_dir)
    current = load_current(config)
    checkpoint, report = run_pipeline(warm_start_config(config), summary_key="nightly-regenerate-summary")
    if is_better(report, current):
        where = promote(config, checkpoint, report)
        baseline = f"{current.acceptance_length:.3f}" if current else "none"
        message = f"promoted drafter: acceptance length {report.acceptance_length:.3f} > {baseline}"
    else:
        where = RunLayout.of(config).current.root
        message = (
            f"kept current drafter: acceptance length {report.acceptance_length:.3f} <= {current.acceptance_length:.3f}"
        )
    events.record(PHASE, DECISION, message, current=str(where))
    create_markdown_artifact(
        f"# Nightly regenerate\n\n{message}\n\nCurrent drafter: `{where}`\n\n"
        f"```json\n{json.dumps(load_current(config).model_dump(), indent=2)}\n```",
        key="nightly-regenerate-decision",
    )
    return report
