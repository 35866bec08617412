"""The `train-drafter` flow: every phase, in order, each a cached and retried Prefect task.

Tasks are called without an enclosing transaction, so each phase commits its own result the moment it
completes: a failed training never rolls back an extraction, and the next run (same config) returns every
completed phase as Cached and resumes the unfinished one from its last shard or checkpoint.

With `orchestration.hosts` > 1, sampling, extraction and training fan out as child flow runs on the `gpu`
pool, one per host (`tasks.hosts`, `flows/host_phase.py`), and their tasks merge what the hosts wrote.

With `extraction.reuse_sampling_server` resolved to reuse (one host), sampling and extraction get one shared vLLM
server (a task parameter outside every cache key); it is stopped right after extraction, or in the
`finally` of that block when either phase fails.

With `training.data: online` the extraction phase does not run: training asks the extraction engine for the
states of its batches while it trains (the shared server stays up through training where reuse decides so).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from prefect import flow
from prefect.artifacts import create_markdown_artifact
from prefect.tasks import Task

from eagle3_core.artifacts import DraftCheckpoint, EvalReport, Manifest, TargetModel
from eagle3_core.config import ConfigError, PipelineConfig
from eagle3_core.devices import host_facts
from eagle3_core.dtypes import record_dtype_decision
from eagle3_core.engine_versions import require_supported_vllm
from eagle3_core.events import RunEvents
from eagle3_core.hidden_states.layers import resolve_layer_ids
from eagle3_core.hosts import host_slice
from eagle3_core.planning.plan import plan_run, render_plan
from eagle3_core.run_lock import run_dir_lock
from flows.hooks import stop_engines
from flows.summary import PhaseRun, write_summary
from tasks.evaluation import evaluate_draft_task
from tasks.extraction import extract_hidden_states_task, extract_on_hosts_task
from tasks.policy import configured
from tasks.sampling import sample_on_hosts_task, sample_prompts_task
from tasks.shared_server import sampling_and_extraction_server
from tasks.target import prepare_target_task
from tasks.training import train_draft_task, train_on_hosts_task, train_online_task
from tasks.vocab import build_vocab_map_task


class PhaseRunner:
    """Calls phase tasks with this run's options and records how each one ended."""

    def __init__(self, config: PipelineConfig):
        self.config = config
        self.phases: list[PhaseRun] = []

    def __call__(self, task: Task, phase: str, *upstream: Manifest, **options: Any) -> Any:
        start = time.monotonic()
        state = configured(task, self.config, phase)(self.config, *upstream, return_state=True, **options)
        seconds = time.monotonic() - start
        self.phases.append(PhaseRun(phase=phase, state=state.name, seconds=seconds, message=state.message or ""))
        return state.result()


def run_all_phases(config: PipelineConfig, runner: Callable[..., Any]) -> tuple[DraftCheckpoint, EvalReport]:
    target = runner(prepare_target_task, "prepare_target")
    resolve_layer_ids(config, target)  # extraction's layers fit the target: known before sampling's weight load
    if config.training.data == "online":
        return run_online(config, runner, target)
    if config.orchestration.hosts > 1:
        samples = runner(sample_on_hosts_task, "sampling", target)
        hidden_states = runner(extract_on_hosts_task, "extraction", samples, target)
    else:
        with sampling_and_extraction_server(config, target) as shared:
            samples = runner(sample_prompts_task, "sampling", target, shared=shared)
            hidden_states = runner(extract_hidden_states_task, "extraction", samples, target, shared=shared)
    vocab_map = runner(build_vocab_map_task, "vocab", samples, target)
    training = train_on_hosts_task if config.orchestration.hosts > 1 else train_draft_task
    checkpoint = runner(training, "training", hidden_states, vocab_map, target)
    report = runner(evaluate_draft_task, "evaluation", checkpoint, target, samples)
    return checkpoint, report


def run_online(
    config: PipelineConfig, runner: Callable[..., Any], target: TargetModel
) -> tuple[DraftCheckpoint, EvalReport]:
    """`training.data: online`: no extraction phase; training asks the extraction engine (the shared sampling
    server where reuse decides so, kept running until training ends) for its states."""
    if config.orchestration.hosts > 1:
        raise ConfigError(
            "training.data=online runs on one host: set orchestration.hosts to 1 or training.data offline"
        )
    with sampling_and_extraction_server(config, target) as shared:
        samples = runner(sample_prompts_task, "sampling", target, shared=shared)
        vocab_map = runner(build_vocab_map_task, "vocab", samples, target)
        checkpoint = runner(train_online_task, "training", samples, vocab_map, target, shared=shared)
    report = runner(evaluate_draft_task, "evaluation", checkpoint, target, samples)
    return checkpoint, report


def post_plan(config: PipelineConfig, key: str) -> PipelineConfig:
    """Check the engine version, record the compute dtypes and server settings this host gives `auto`, post
    the plan (what each phase will do and cost, what is done) as a markdown artifact; the config resolved."""
    require_supported_vllm(config)
    events = RunEvents(config.run_dir)
    record_dtype_decision(config, events, "flow")
    plan = plan_run(config, host_facts())
    plan.run.record(events, "flow")
    create_markdown_artifact(render_plan(plan, config.run_dir), key=key, description="What each phase will do")
    return plan.run.config


def run_pipeline(config: PipelineConfig, summary_key: str) -> tuple[DraftCheckpoint, EvalReport]:
    """The plan, every phase, then the summary (also after a failure: it says which phase failed and why)."""
    started = time.time()
    config = post_plan(config, summary_key.replace("summary", "plan"))
    runner = PhaseRunner(config)
    checkpoint: DraftCheckpoint | None = None
    report: EvalReport | None = None
    try:
        checkpoint, report = run_all_phases(config, runner)
    finally:
        markdown, _ = write_summary(config.run_dir, started, runner.phases, report, checkpoint)
        create_markdown_artifact(markdown, key=summary_key, description="What ran, what was cached")
    return checkpoint, report


@flow(
    name="train-drafter",
    description="Sample, extract, map the vocabulary, train and evaluate an EAGLE-3 drafter.",
    on_cancellation=[stop_engines],
    on_crashed=[stop_engines],
)
def train_drafter(config: PipelineConfig) -> EvalReport:
    """Run every phase (cached phases return at once) and end with a markdown summary artifact; the run folder's
    writer lock held throughout (`eagle3_core.run_lock`: a second writer is refused, naming this run)."""
    with run_dir_lock(config.run_dir, host_slice(config)):
        _, report = run_pipeline(config, summary_key="train-drafter-summary")
    return report
