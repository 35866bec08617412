"""Prefect task of phase 0, prepare target. Keyed on the target section and on the identity of the model it
names: the embedded GGUF's or a local folder's files (sizes and modification times, not contents: hashing a
547 GB folder on every run would cost more than the phase), so a new target revision in the same folder runs
the phase again; a Hub id's commit sha, asked of the Hub (or the cache's ref offline) on every run, so a moved
branch runs the phase again and every phase after it (they key on the TargetModel's digest, which holds the
sha)."""

from __future__ import annotations

from typing import Any

from prefect import task

from eagle3_core.artifacts import TargetModel
from eagle3_core.config import PipelineConfig
from eagle3_core.events import RunEvents
from eagle3_core.files import folder_identity
from eagle3_core.phases import PREPARE_TARGET
from eagle3_core.target.hub import HubTargetError, resolve_commit
from eagle3_core.target.prepare import prepare_target
from eagle3_core.target.reference import embedded_gguf, reference_of
from tasks.policy import PhaseCachePolicy, phase_task_options, run_phase
from tasks.progress import PrefectProgress

PHASE = PREPARE_TARGET.name


def target_identity(config: PipelineConfig) -> Any:
    """(name, size, mtime_ns) of the embedded GGUF or of every file in the local target folder; a Hub id's
    repo and the commit its revision names now (a Hub id that cannot be resolved keys the failing run only:
    Prefect would log a failed key computation as a traceback of its own)."""
    reference = reference_of(config.target.model)
    if reference.kind == "embedded":
        gguf = embedded_gguf(reference.model)
        return [(gguf.name, (st := gguf.stat()).st_size, st.st_mtime_ns)]
    hub = reference.hub
    if hub is not None:
        try:
            return {"repo_id": hub.repo_id, "commit": resolve_commit(hub)}
        except HubTargetError as exc:  # the task meets it again and fails with it: the run's one error line
            return {"repo_id": hub.repo_id, "unresolved": str(exc)}
    return folder_identity(reference.folder)


POLICY = PhaseCachePolicy(spec=PREPARE_TARGET, extra=target_identity)


@task(**phase_task_options(POLICY))
def prepare_target_task(config: PipelineConfig) -> TargetModel:
    """Convert, describe or download the target (CPU only: no GPU slot), with a Hub download's progress."""
    progress = PrefectProgress(config.orchestration.progress_interval_s)
    return run_phase(PHASE, lambda: prepare_target(config.target, RunEvents(config.run_dir), progress))
