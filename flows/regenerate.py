"""The `nightly-regenerate` flow: new prompts or a new target revision, in the SAME run directory.

Sampling and extraction resume by id, so only new prompts are sampled and only new samples extracted; the
draft is trained from the current one (`training.warm_start`), evaluated, and kept as `current` only if its
acceptance length beats the current drafter's. `current` is a copied folder (not a symlink into `draft/`,
which the next training overwrites) holding the exported drafter, its manifests and `current.json`.
"""

from __future__ import annotations

import json
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
from eagle3_core.run_layout import DraftLayout, RunLayout
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
    path = RunLayout.of(config).current.record
    return CurrentDrafter.model_validate_json(path.read_text()) if path.exists() else None


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
    """Copy the exported drafter, its checkpoint manifest and its report to `current.new/` (not the
    training state: it is only for resuming, and large), then swap it in place of `current/`."""
    current = RunLayout.of(config).current
    staging, retired = current.beside(".new"), current.beside(".old")
    for stale in (staging, retired):
        shutil.rmtree(stale.root, ignore_errors=True)
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
    if current.root.exists():
        current.root.rename(retired.root)
    staging.root.rename(current.root)
    shutil.rmtree(retired.root, ignore_errors=True)
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
