"""Prefect task of phase 0, prepare target. Keyed on the target section and on the identity of the model
files it names (sizes and modification times, not contents: hashing a 547 GB folder on every run would
cost more than the phase), so a new target revision in the same folder runs the phase again."""

from __future__ import annotations

from prefect import task

from eagle3_core.artifacts import TargetModel
from eagle3_core.config import PipelineConfig
from eagle3_core.events import RunEvents
from eagle3_core.files import folder_identity
from eagle3_core.phases import PREPARE_TARGET
from eagle3_core.target.prepare import EMBEDDED, embedded_gguf, prepare_target
from tasks.policy import PhaseCachePolicy, phase_task_options, run_phase

PHASE = PREPARE_TARGET.name


def target_files_identity(config: PipelineConfig) -> list[tuple[str, int, int]] | None:
    """(name, size, mtime_ns) of the embedded GGUF or of every file in the local target folder."""
    if config.target.model in EMBEDDED:
        gguf = embedded_gguf(config.target.model)
        return [(gguf.name, (st := gguf.stat()).st_size, st.st_mtime_ns)]
    return folder_identity(config.target.model)


POLICY = PhaseCachePolicy(spec=PREPARE_TARGET, extra=target_files_identity)


@task(**phase_task_options(POLICY))
def prepare_target_task(config: PipelineConfig) -> TargetModel:
    """Convert or describe the target (CPU only: no GPU slot)."""
    return run_phase(PHASE, lambda: prepare_target(config.target, RunEvents(config.run_dir)))
