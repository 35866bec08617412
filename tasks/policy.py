"""What every phase task shares: the content-keyed cache policy, the retry condition, and the per-run task
options (result storage under the run root, timeout, retries with backoff).

A phase's cache key is a digest of (phase name, phase format version, every config field not marked
operational for the phase: `eagle3_core.phases`, whose marks the core's resume keys come from too; the
content of inputs that live outside the config; the upstream manifests' digests). The task's source is NOT
part of it: a comment edit must not invalidate a 25-minute extraction; a change of the on-disk format bumps
the phase's version instead. A stored result is trusted only if its manifest still validates (its files
exist, unchanged) and is final (a SampleSet without error rows); otherwise the record is deleted and the
phase runs again.
"""

from __future__ import annotations

import asyncio
import contextvars
import errno
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from prefect.cache_policies import CachePolicy
from prefect.context import TaskRunContext
from prefect.tasks import Task, exponential_backoff

from eagle3_core.artifacts import ArtifactInvalid, Manifest, SampleSet
from eagle3_core.config import ConfigError, PipelineConfig
from eagle3_core.events import CACHE_HIT, DECISION, RunEvents
from eagle3_core.faults import InjectedFault, check_fault, faulting_progress
from eagle3_core.files import DiskFullError, sha256_json
from eagle3_core.phases import KEYED_ROLES, PhaseSpec, keyed_fields
from eagle3_core.preflight import PreflightError
from eagle3_core.progress import ProgressCallback
from eagle3_core.run_layout import RunLayout
from eagle3_core.serving.engine import EngineDied
from tasks.gpu_slot import phase_slot
from tasks.progress import PrefectProgress
from tasks.secrets import export_api_key

ExtraContent = Callable[[PipelineConfig], Any]
R = TypeVar("R")


def as_config(value: Any) -> PipelineConfig:
    return value if isinstance(value, PipelineConfig) else PipelineConfig.model_validate(value)


@dataclass
class PhaseCachePolicy(CachePolicy):
    """Content key of one phase (see the module docstring): its declaration's name and version, and every
    config field not marked operational for it (`eagle3_core.phases`); `extra` returns the content of
    inputs the config only names (prompt files, a local target folder, a warm-start checkpoint)."""

    spec: PhaseSpec = field(kw_only=True)
    extra: ExtraContent | None = field(default=None)

    def key_content(self, config: PipelineConfig, upstream: dict[str, Manifest]) -> dict[str, Any]:
        return {
            "phase": self.spec.name,
            "version": self.spec.version,
            "config": keyed_fields(config, self.spec.name, KEYED_ROLES),
            "extra": self.extra(config) if self.extra else None,
            "upstream": {name: manifest.digest for name, manifest in sorted(upstream.items())},
        }

    def compute_key(
        self,
        task_ctx: TaskRunContext,
        inputs: dict[str, Any],
        flow_parameters: dict[str, Any],
        **kwargs: Any,
    ) -> str:
        config = as_config(inputs["config"])
        upstream = {name: value for name, value in inputs.items() if isinstance(value, Manifest)}
        key = f"{self.spec.name}-{sha256_json(self.key_content(config, upstream))}"
        refreshing = bool(task_ctx.task.refresh_cache)
        if not refreshing:
            drop_invalid_record(task_ctx, key, self.spec.name, RunEvents(config.run_dir))
        return key


def unfinished_rows(manifest: Manifest) -> str | None:
    """Why a stored result is not final though its files are intact: a SampleSet with error rows (they are
    retried, as `eagle3 sample` retries them); None for a final one."""
    if isinstance(manifest, SampleSet) and manifest.error:
        return f"its {manifest.error} error rows are retried"
    return None


def drop_invalid_record(task_ctx: TaskRunContext, key: str, phase: str, events: RunEvents) -> None:
    """Validate the manifest stored under `key`: record a CACHE_HIT if it holds, else delete the record so
    the phase runs again instead of returning files that are gone or changed."""
    store = task_ctx.result_store
    if not store.exists(key):
        return
    try:
        manifest = store.read(key).result
        if not isinstance(manifest, Manifest):
            raise ArtifactInvalid(f"stored result is a {type(manifest).__name__}, not a manifest")
        manifest.validate()
        if unfinished := unfinished_rows(manifest):
            raise ArtifactInvalid(unfinished)
    except Exception as exc:
        record_path = Path(store.result_storage._resolve_path(key))  # type: ignore[union-attr]
        record_path.unlink(missing_ok=True)
        events.record(phase, DECISION, f"cached result invalid, running again: {exc}", key=key)
        return
    events.record(phase, CACHE_HIT, f"cached {manifest.kind} is valid, not running", key=key)


DETERMINISTIC = (
    ValueError,  # bad input, ConfigError and pydantic's ValidationError included
    TypeError,
    KeyError,
    AttributeError,  # a bug fails the same way every time
    NameError,
    ImportError,
    NotImplementedError,
    FileNotFoundError,
    NotADirectoryError,
    IsADirectoryError,
    PermissionError,
    MemoryError,
    ArtifactInvalid,
    InjectedFault,
    ConfigError,
    DiskFullError,  # space must be freed first
    PreflightError,
)
# Matched by name: importing them would load torch or the evaluation phase into every task module.
DETERMINISTIC_NAMES = {"OutOfMemoryError", "AcceptanceBelowFloor"}
# A full disk or quota stays full after another weight load.
DISK_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
# Matched in messages too: pyarrow and safetensors raise OSError without an errno.
DETERMINISTIC_MESSAGES = ("out of memory", "no space left on device", "disk quota exceeded")
# Transient whatever it caused: an engine that died mid-phase makes its in-flight requests fail in any way
# (a 5xx read as a bad shard, a half-written file), and a new engine resumes the work.
TRANSIENT = (EngineDied,)


def exception_chain(exc: BaseException) -> list[BaseException]:
    chain: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in chain:
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain


def is_deterministic(exc: BaseException) -> bool:
    """True for failures a retry would repeat: bad input, out of memory, a full disk, a failed validation
    (of an artifact or of the acceptance floor), an injected fault. The chain is read from the outermost
    exception in; the first link that is deterministic or `TRANSIENT` decides (an engine that died of
    out of memory is deterministic: its log says so)."""
    for link in exception_chain(exc):
        if isinstance(link, DETERMINISTIC) or type(link).__name__ in DETERMINISTIC_NAMES:
            return True
        if any(message in str(link).lower() for message in DETERMINISTIC_MESSAGES):
            return True
        if isinstance(link, OSError) and link.errno in DISK_FULL_ERRNOS:
            return True
        if isinstance(link, TRANSIENT):
            return False
    return False


def retry_transient(task: Task, task_run: Any, state: Any) -> bool:
    """Prefect `retry_condition_fn`: retry engine crashes, lost connections and timeouts, never the
    deterministic failures (which would fail the same way after another weight load)."""
    exc = state.data if isinstance(state.data, BaseException) else state.result(raise_on_failure=False)
    if isinstance(exc, BaseException):
        return not is_deterministic(exc)
    return True


def result_storage_dir(config: PipelineConfig) -> Path:
    """Where task results (JSON manifests) persist: the configured path, or under the run root."""
    path = config.orchestration.result_storage or RunLayout.of(config).prefect_results
    return Path(path).expanduser().resolve()


def configured(task: Task, config: PipelineConfig, phase: str) -> Task:
    """The task with this run's options: result storage, timeout, retries with exponential backoff. The
    server's API key, where it lives in a Prefect Secret block, is put into this process's environment."""
    export_api_key(config.server)
    orchestration = config.orchestration
    storage = result_storage_dir(config)
    storage.mkdir(parents=True, exist_ok=True)
    delays = exponential_backoff(orchestration.retry_delay_s)(orchestration.retries) if orchestration.retries else 0
    return task.with_options(
        result_storage=storage,
        timeout_seconds=orchestration.timeouts_s.get(phase),
        retries=orchestration.retries,
        retry_delay_seconds=delays,
    )


def phase_task_options(policy: PhaseCachePolicy) -> dict[str, Any]:
    """Decorator options shared by every phase task (the per-run ones are set by `configured`)."""
    return {
        "name": policy.spec.name,
        "cache_policy": policy,
        "persist_result": True,
        "result_serializer": "json",
        "retry_condition_fn": retry_transient,
    }


def call_outside_event_loop(call: Callable[[], R]) -> R:
    """Phases may call `asyncio.run()`, which is refused in a thread whose event loop is running, as under
    an async runner (`prefect flow-run retry` runs the flow that way): then run the phase in a fresh
    thread, with this context (the task run, its settings)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return call()
    context = contextvars.copy_context()
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="phase") as pool:
        return pool.submit(context.run, call).result()


def run_phase(phase: str, call: Callable[[], R]) -> R:
    """Run a phase function between the `start` and `end` fault points of EAGLE3_FAULT."""
    check_fault(phase, "start")
    result = call_outside_event_loop(call)
    check_fault(phase, "end")
    return result


def run_gpu_phase(
    phase: str,
    config: PipelineConfig,
    call: Callable[[RunEvents, ProgressCallback], R],
    shared: object | None = None,
) -> R:
    """The body of every GPU phase task: `call(events, progress)` holding the `gpu` slot (none when it uses
    the `shared` server, which holds the slot itself), with progress reported to Prefect through the
    EAGLE3_FAULT points of `faulting_progress`, between `run_phase`'s start and end fault points."""
    events = RunEvents(config.run_dir)
    with phase_slot(config.orchestration.gpu_limit, shared, events):
        progress = faulting_progress(phase, PrefectProgress(config.orchestration.progress_interval_s))
        return run_phase(phase, lambda: call(events, progress))
