"""Prefect task of phase 0, prepare target. Keyed on the target section and on the identity of the model
files it names (sizes and modification times, not contents: hashing a 547 GB folder on every run would
cost more than the phase), so a new target revision in the same folder runs the phase again."""

from __future__ import annotations

from pathlib import Path

from prefect import task

from eagle3_core.artifacts import TargetModel
from eagle3_core.config import PipelineConfig
from eagle3_core.events import RunEvents
from eagle3_core.target.prepare import EMBEDDED, embedded_gguf, prepare_target
from tasks.policy import PhaseCachePolicy, phase_task_options, run_phase

PHASE = "prepare_target"


def target_files_identity(config: PipelineConfig) -> list[tuple[str, int, int]]:
    """(name, size, mtime_ns) of the embedded GGUF or of every file in the local target folder."""
    if config.target.model in EMBEDDED:
        files = [embedded_gguf(config.target.model)]
    else:
        files = sorted(p for p in Path(config.target.model).expanduser().rglob("*") if p.is_file())
    return [(p.name, (st := p.stat()).st_size, st.st_mtime_ns) for p in files]


POLICY = PhaseCachePolicy(phase=PHASE, version=1, include=("target",), extra=target_files_identity)


@task(**phase_task_options(POLICY))
def prepare_target_task(config: PipelineConfig) -> TargetModel:
    """Convert or describe the target (CPU only: no GPU slot)."""
    return run_phase(PHASE, lambda: prepare_target(config.target, RunEvents(config.run_dir)))
