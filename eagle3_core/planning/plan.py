"""A run's plan before it runs: per phase, what it would do, what it costs (tokens, disk, GPU memory a
rank, steps), which engines it starts, and whether it is already done and will be skipped. Computed from
the config, the host's `DeviceFacts`, the target's config.json and safetensors index and the run folder's
manifests; no weight is loaded and nothing is written. `eagle3 plan`, `eagle3 run --dry-run` and the
flow's first artifact print the same text (`render_plan`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from eagle3_core.artifacts import TargetModel
from eagle3_core.config import PipelineConfig
from eagle3_core.devices import GIB, DeviceFacts
from eagle3_core.evaluation.phase import served_unavailable
from eagle3_core.hidden_states.layers import resolve_layer_ids
from eagle3_core.model_size import ModelSize, model_size
from eagle3_core.planning.cached import DonePhases, find_done
from eagle3_core.planning.estimate import (
    TokenEstimate,
    expected_tokens,
    hidden_state_bytes,
    online_buffer_bytes,
    rank_memory,
    share,
    training_processes,
    training_steps,
)
from eagle3_core.sampling.prompts import Prompt, load_prompts
from eagle3_core.sampling.table import is_heldout
from eagle3_core.server_defaults import device_env, resolved_server_config, server_decision, target_size
from eagle3_core.target.prepare import EMBEDDED
from eagle3_core.training.preflight import draft_parameters, training_memory_bytes

RUNS, SKIPPED = "runs", "skipped (done)"
CPU_KV_SPACE = "VLLM_CPU_KVCACHE_SPACE"


@dataclass(frozen=True)
class PhasePlan:
    phase: str
    status: str  # RUNS, SKIPPED, or how it resumes
    does: str
    costs: list[str] = field(default_factory=list)
    engines: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class RunPlan:
    host: str
    server: str
    phases: list[PhasePlan]
    problems: list[str]
    hidden_state_bytes: int  # what extraction still writes (0 when done), for `eagle3 doctor`'s disk check

    def phase(self, name: str) -> PhasePlan:
        return next(p for p in self.phases if p.phase == name)


def gb(value: float) -> str:
    return f"{value / 1e9:,.1f} GB" if value >= 1e9 else f"{value / 1e6:,.1f} MB"


def gib(value: float) -> str:
    return f"{value / GIB:,.1f} GiB"


def engine_line(config: PipelineConfig, facts: DeviceFacts, what: str) -> str:
    """The vLLM server a phase starts, as it will be started on `facts` (the config resolved there)."""
    server = config.server
    if server.engine == "external":
        return f"none: the external server at {server.url}"
    if not facts.cuda:
        space = {**device_env(facts), **server.env}.get(CPU_KV_SPACE, "vLLM's default")
        return f"vllm-cpu {what}: 1 engine, eager, KV cache {space} GiB ({CPU_KV_SPACE})"
    graphs = "eager" if server.enforce_eager else "CUDA graphs"
    return (
        f"vLLM {what}: {server.data_parallel_size} engine(s) x tensor_parallel_size {server.tensor_parallel_size} "
        f"on {server.data_parallel_size * server.tensor_parallel_size} of {facts.gpu_count} GPUs, {graphs}, "
        f"gpu_memory_utilization {server.gpu_memory_utilization}"
    )


def memory_line(config: PipelineConfig, facts: DeviceFacts, size: ModelSize | None) -> tuple[str | None, str | None]:
    """(GPU memory a rank, the problem where the weights leave no room for one max_model_len sequence)."""
    memory = rank_memory(size, facts, config.server) if size else None
    if memory is None:
        return None, None
    length = config.server.max_model_len
    kv = (
        f"{gib(memory.kv_cache)} of KV cache (~{memory.kv_tokens:,} tokens, {memory.kv_tokens / length:.1f} x "
        f"max_model_len {length:,})"
        if memory.kv_cache > 0
        else "no room for a KV cache"
    )
    line = (
        f"GPU memory a rank: {gib(memory.weights)} of weights + {kv} in {gib(memory.usable)} "
        f"({config.server.gpu_memory_utilization} of {gib(facts.gpu_memory_bytes)})"
    )
    if memory.fits(length):
        return line, None
    return line, (
        f"server: {gib(memory.weights)} of weights a rank leave {gib(max(0.0, memory.kv_cache))} of "
        f"{gib(memory.usable)} for the KV cache, less than one {length:,}-token sequence "
        f"({gib(memory.kv_bytes_per_token * length)}): more GPUs (tensor_parallel_size), GPUs with more memory, "
        "or a smaller server.max_model_len"
    )


def device_on(device: str, facts: DeviceFacts) -> str:
    """A torch device setting as it runs on `facts`: auto is cuda on a GPU host, else cpu."""
    return ("cuda" if facts.cuda else "cpu") if device == "auto" else device


def status_of(done: object, partial: str | None = None) -> str:
    return SKIPPED if done is not None else partial or RUNS


def sampling_plan(config: PipelineConfig, facts: DeviceFacts, rows: TokenEstimate, done: DonePhases) -> PhasePlan:
    partial = f"resumes: {done.ok_rows:,} of {rows.samples:,} rows done" if done.ok_rows else None
    return PhasePlan(
        "sampling",
        status_of(done.samples, partial),
        f"{rows.samples:,} responses of at most {config.sampling.max_tokens:,} tokens",
        [f"~{rows.tokens:,} tokens, {rows.tokens_per_sample:,.0f} a sample ({rows.source})"],
        [engine_line(config, facts, "OpenAI server")],
    )


def extraction_plan(
    config: PipelineConfig, facts: DeviceFacts, train_rows: TokenEstimate, hidden_size: int, done: DonePhases
) -> tuple[PhasePlan, int]:
    ex = config.extraction
    stored = hidden_state_bytes(train_rows.tokens, hidden_size, ex.dtype)
    shards = math.ceil(train_rows.samples / ex.samples_per_shard) if train_rows.samples else 0
    if ex.backend == "vllm":
        sharing = {
            "on": " (the sampling server, kept)",
            "auto": " (or the sampling server: reuse_sampling_server auto)",
        }
        shared = sharing.get(ex.reuse_sampling_server, "")
        engine = engine_line(config, facts, f"extract_hidden_states{shared}")
    else:
        engine = f"transformers in this process on {device_on(ex.device, facts)} (one weight load)"
    plan = PhasePlan(
        "extraction",
        status_of(done.hidden_states),
        f"prefill of {train_rows.samples:,} training rows (not held out), {shards:,} shards of {ex.samples_per_shard}",
        [f"hidden states: {gb(stored)} at {ex.dtype} (~{train_rows.tokens:,} tokens x H {hidden_size:,})"],
        [engine],
    )
    return plan, 0 if done.hidden_states else stored


def draft_line(config: PipelineConfig, target: TargetModel) -> str:
    """The draft's trainable parameters and memory a training process, or why it cannot be built."""
    try:
        layer_ids = resolve_layer_ids(config, target)
        vocab = min(config.vocab.draft_vocab_size, target.vocab_size)
        trainable, frozen = draft_parameters(config.training, target, vocab, layer_ids)
    except ValueError as exc:  # ConfigError included: the phases' preflights refuse it the same way
        return f"draft: not buildable ({exc})"
    memory = gib(training_memory_bytes(trainable, frozen))
    return f"draft: {trainable / 1e6:,.0f}M trainable parameters, {memory} a process before activations"


def training_plan(config: PipelineConfig, facts: DeviceFacts, trained: int, done: DonePhases) -> PhasePlan:
    tc = config.training
    processes = training_processes(tc, facts)
    steps = training_steps(trained, tc, processes)
    costs = [
        f"{steps.total:,} steps ({steps.epochs}; {steps.steps_per_epoch:,} an epoch) on {steps.samples:,} samples, "
        f"batch {tc.batch_size} a process"
    ]
    if done.target is not None:
        costs.append(draft_line(config, done.target))
    where = f"torchrun, {processes} processes" if processes > 1 else f"this process on {device_on(tc.device, facts)}"
    return PhasePlan(
        "training", status_of(done.draft), f"{tc.draft_architecture} draft, {tc.optimizer}", costs, [where]
    )


def data_comparison(config: PipelineConfig, train_rows: TokenEstimate, hidden_size: int, epochs: float) -> str:
    """Offline's disk and prefill against online's for this config (`training.data` marked chosen): online
    stores no set but prefills the samples of every epoch again, unless `training.online_cache_gb` keeps them."""
    ex, tc = config.extraction, config.training
    stored = hidden_state_bytes(train_rows.tokens, hidden_size, ex.dtype)
    per_sample = train_rows.tokens_per_sample
    buffer = online_buffer_bytes(ex.concurrency, tc.online_prefetch, per_sample, hidden_size, ex.dtype)
    passes = min(1.0, epochs) if tc.online_cache_gb * 1e9 >= stored else epochs
    offline, online = (f"{name}{' (chosen)' if tc.data == name else ''}" for name in ("offline", "online"))
    return (
        f"{offline}: {gb(stored)} of hidden states on disk, ~{train_rows.tokens:,} tokens prefilled once; {online}: "
        f"at most {gb(buffer)} of states at a time ({ex.concurrency} requests in flight + online_prefetch "
        f"{tc.online_prefetch}), ~{round(train_rows.tokens * passes):,} tokens prefilled ({passes:.2g} epochs) "
        "beside training"
    )


def evaluation_plan(config: PipelineConfig, facts: DeviceFacts, heldout: int, done: DonePhases) -> PhasePlan:
    ev = config.evaluation
    cap = ev.max_prompts
    sets = [f"{name} (up to {cap})" if cap else name for name in ev.prompt_sets]
    engines = [f"transformers in this process on {device_on(ev.device, facts)} (a)"] if ev.with_transformers else []
    unavailable = served_unavailable(config)
    if unavailable is None:
        what = "server for (b): the target, then target + draft"
        sglang = f"SGLang {what}, tp {config.server.tensor_parallel_size} (evaluation.sglang_python's environment)"
        engines.append(sglang if ev.engine == "sglang" else engine_line(config, facts, what))
    else:
        engines.append(f"no served measurement (b): {unavailable}")
    return PhasePlan(
        "evaluation",
        status_of(done.report),
        f"acceptance at k={ev.num_speculative_tokens} on {', '.join(sets)}; {heldout:,} held-out rows",
        [f"up to {ev.max_new_tokens} new tokens a prompt"],
        engines,
    )


def size_of(config: PipelineConfig, done: DonePhases) -> ModelSize | None:
    """The target's size from its folder (a local one, or the embedded target once converted)."""
    size = target_size(config.target.model)
    if size is None and done.target is not None:
        return model_size(done.target.root_path)
    return size


def plan_run(config: PipelineConfig, facts: DeviceFacts, prompts: list[Prompt] | None = None) -> RunPlan:
    """The plan of `config` on a host with `facts` (see the module docstring)."""
    decision, _ = server_decision(config, facts)
    config = resolved_server_config(config, facts)
    sc = config.sampling
    prompts = load_prompts(sc.prompt_files, sc.max_prompts) if prompts is None else prompts
    done = find_done(config, prompts)
    size = size_of(config, done)
    rows = expected_tokens(prompts, sc.responses_per_prompt, sc.max_tokens)
    if done.samples is not None and done.samples.ok:
        rows = TokenEstimate(
            rows.samples, done.samples.tokens / done.samples.ok, f"the SampleSet in {done.samples.root}"
        )
    kept = [p for p in prompts if not is_heldout(p.id, sc.holdout_fraction)]
    train_rows = share(rows, len(kept) * sc.responses_per_prompt, rows.source)
    validation = sum(is_heldout(f"draft-validation:{p.id}", config.training.holdout_fraction) for p in kept)
    hidden_size = size.hidden_size if size else done.target.hidden_size if done.target else 0
    target = prepare_plan(config, done, size)
    sampling = sampling_plan(config, facts, rows, done)
    memory, problem = memory_line(config, facts, size)
    if memory:
        sampling.costs.append(memory)
    extraction, stored = extraction_plan(config, facts, train_rows, hidden_size, done)
    if config.training.data == "online":  # no set is stored: its engine runs beside training
        extraction, stored = PhasePlan("extraction", "skipped (training.data online)", extraction.does), 0
    vocab = PhasePlan(
        "vocab",
        status_of(done.vocab),
        f"counts the trained tokens of {train_rows.samples:,} rows; draft vocabulary {config.vocab.draft_vocab_size:,}",
    )
    trained = (len(kept) - validation) * sc.responses_per_prompt
    training = training_plan(config, facts, trained, done)
    epochs = training_steps(trained, config.training, training_processes(config.training, facts))
    passes = epochs.total / epochs.steps_per_epoch if epochs.steps_per_epoch else 0.0
    training.costs.append(data_comparison(config, train_rows, hidden_size, passes))
    if config.training.data == "online":
        training.engines.extend(extraction_plan(config, facts, train_rows, hidden_size, done)[0].engines)
    phases = [
        target,
        sampling,
        extraction,
        vocab,
        training,
        evaluation_plan(config, facts, rows.samples - train_rows.samples, done),
    ]
    missing = None if size or config.target.model in EMBEDDED else f"target.model {config.target.model}: no config.json"
    return RunPlan(facts.describe(), decision, phases, [p for p in (missing, problem) if p], stored)


def prepare_plan(config: PipelineConfig, done: DonePhases, size: ModelSize | None) -> PhasePlan:
    weights = (
        [f"{size.parameters / 1e9:,.2f}B parameters, {gb(size.weight_bytes)} of weights ({size.weight_source})"]
        if size
        else []
    )
    if done.target is not None:
        where = "in place" if done.target.source == "local" else "converted already"
        return PhasePlan("prepare_target", where, f"{done.target.name} at {done.target.root}", weights)
    return PhasePlan("prepare_target", RUNS, f"converts the embedded {config.target.model} GGUF once (one weight load)")


def render_plan(plan: RunPlan, run_dir: object) -> str:
    """The plan as markdown: the host, the server's resolved settings, then a section per phase."""
    lines = [f"# Plan of {run_dir}", "", f"- host: {plan.host}", f"- {plan.server}"]
    for problem in plan.problems:
        lines.append(f"- **problem**: {problem}")
    for phase in plan.phases:
        lines += ["", f"## {phase.phase}: {phase.status}", f"- does: {phase.does}"]
        lines += [f"- costs: {cost}" for cost in phase.costs]
        lines += [f"- engine: {engine}" for engine in phase.engines]
    return "\n".join(lines) + "\n"
