"""Prefect task of phase 1, serve and sample. Keyed on the sampling and server settings that change what
is generated, and on the prompt files' contents (a file edited in place is new data, under the same name)."""

from __future__ import annotations

from pathlib import Path

from prefect import task

from eagle3_core.artifacts import SampleSet, TargetModel
from eagle3_core.config import PipelineConfig
from eagle3_core.events import RunEvents
from eagle3_core.faults import faulting_progress
from eagle3_core.files import sha256_file
from eagle3_core.prompts import DEMO, demo_prompts_path
from eagle3_core.shared_server import SharedServer
from tasks.gpu import phase_slot
from tasks.policy import SERVER_OPERATIONAL, PhaseCachePolicy, phase_task_options, run_phase
from tasks.progress import PrefectProgress

PHASE = "sampling"


def prompt_files_content(config: PipelineConfig) -> dict[str, str]:
    """Prompt file name -> sha256 (`demo` is the bundled set); a missing file keys as such (the phase then
    fails with the error naming it)."""
    digests = {}
    for name in config.sampling.prompt_files:
        path = demo_prompts_path() if name == DEMO else Path(name).expanduser()
        digests[name] = sha256_file(path) if path.is_file() else "missing"
    return digests


POLICY = PhaseCachePolicy(
    phase=PHASE,
    version=1,
    include=("server", "sampling"),
    exclude=(
        *SERVER_OPERATIONAL,
        "sampling.concurrency",
        "sampling.request_timeout_s",
        "sampling.retry_backoff_s",
    ),
    extra=prompt_files_content,
)


@task(**phase_task_options(POLICY))
def sample_prompts_task(config: PipelineConfig, target: TargetModel, shared: SharedServer | None = None) -> SampleSet:
    """Sample every prompt not sampled yet; the phase starts and stops its own engine (try/finally), or
    uses `shared` (a SharedServer the flow stops; part of no cache key)."""
    from eagle3_core.sampling import sample_prompts

    with phase_slot(config.orchestration.gpu_limit, shared, RunEvents(config.run_dir)):
        progress = faulting_progress(PHASE, PrefectProgress(config.orchestration.progress_interval_s))
        events = RunEvents(config.run_dir)
        return run_phase(PHASE, lambda: sample_prompts(config, target, events, progress=progress, server=shared))
