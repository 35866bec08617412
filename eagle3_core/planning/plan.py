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
from eagle3_core.model_size import ModelSize
from eagle3_core.planning.cached import DonePhases, find_done, known_target
from eagle3_core.planning.estimate import (
    TokenEstimate,
    TrainingSteps,
    expected_tokens,
    hidden_state_bytes,
    online_buffer_bytes,
    rank_memory,
    share,
    training_steps,
)
from eagle3_core.planning.problems import run_problems
from eagle3_core.resolved_run import ResolvedRun, resolve_run, shape_of
from eagle3_core.sampling.chat_tokens import ChatTokenizer
from eagle3_core.sampling.prompts import Prompt, load_prompts
from eagle3_core.sampling.table import is_heldout
from eagle3_core.target.reference import TargetShape, folder_shape
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
    problems: list[str]  # each names the field (or file) to change: the plan cannot run as it stands
    hidden_state_bytes: int  # what extraction still writes (0 when done), for `eagle3 doctor`'s disk check
    run: ResolvedRun
    hidden_states_total: int  # what extraction writes for the whole run (done or not)
    steps: TrainingSteps

    def phase(self, name: str) -> PhasePlan:
        return next(p for p in self.phases if p.phase == name)


def gb(value: float) -> str:
    return f"{value / 1e9:,.1f} GB" if value >= 1e9 else f"{value / 1e6:,.1f} MB"


def gib(value: float) -> str:
    return f"{value / GIB:,.1f} GiB"


def engine_line(config: PipelineConfig, run: ResolvedRun, what: str) -> str:
    """The vLLM server a phase starts, as it will be started on the run's host (the config resolved there)."""
    facts = run.facts
    server = config.server
    if server.engine == "external":
        return f"none: the external server at {server.url}"
    if not facts.cuda:
        space = {**run.env, **server.env}.get(CPU_KV_SPACE, "vLLM's default")
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


def sampling_plan(config: PipelineConfig, run: ResolvedRun, rows: TokenEstimate, done: DonePhases) -> PhasePlan:
    partial = f"resumes: {done.ok_rows:,} of {rows.samples:,} rows done" if done.ok_rows else None
    return PhasePlan(
        "sampling",
        status_of(done.samples, partial),
        f"{rows.samples:,} responses of at most {config.sampling.max_tokens:,} tokens",
        [f"~{rows.tokens:,} tokens, {rows.tokens_per_sample:,.0f} a sample ({rows.source})"],
        [engine_line(config, run, "OpenAI server")],
    )


def extraction_plan(
    config: PipelineConfig, run: ResolvedRun, train_rows: TokenEstimate, hidden_size: int, done: DonePhases
) -> tuple[PhasePlan, int]:
    """The phase, and the bytes its hidden states take."""
    ex = config.extraction
    stored = hidden_state_bytes(train_rows.tokens, hidden_size, ex.dtype)
    shards = math.ceil(train_rows.samples / ex.samples_per_shard) if train_rows.samples else 0
    if ex.backend == "vllm":
        sharing = {
            "on": " (the sampling server, kept)",
            "auto": " (or the sampling server: reuse_sampling_server auto)",
        }
        shared = sharing.get(ex.reuse_sampling_server, "")
        engine = engine_line(config, run, f"extract_hidden_states{shared}")
    else:
        engine = f"transformers in this process on {device_on(ex.device, run.facts)} (one weight load)"
    plan = PhasePlan(
        "extraction",
        status_of(done.hidden_states),
        f"prefill of {train_rows.samples:,} training rows (not held out), {shards:,} shards of {ex.samples_per_shard}",
        [f"hidden states: {gb(stored)} at {ex.dtype} (~{train_rows.tokens:,} tokens x H {hidden_size:,})"],
        [engine],
    )
    return plan, stored


def draft_line(config: PipelineConfig, target: TargetModel) -> tuple[str, str | None]:
    """The draft's trainable parameters and memory a training process; or why it cannot be built (a problem)."""
    try:
        layer_ids = resolve_layer_ids(config, target)
        vocab = min(config.vocab.draft_vocab_size, target.vocab_size)
        trainable, frozen = draft_parameters(config.training, target, vocab, layer_ids)
    except ValueError as exc:  # ConfigError included: the phases' preflights refuse it the same way
        return f"draft: not buildable ({exc})", f"draft: {exc}"
    memory = gib(training_memory_bytes(trainable, frozen))
    return f"draft: {trainable / 1e6:,.0f}M trainable parameters, {memory} a process before activations", None


def training_plan(
    config: PipelineConfig, run: ResolvedRun, lengths: list[int], draft: str | None, done: DonePhases
) -> tuple[PhasePlan, TrainingSteps]:
    tc, facts = config.training, run.facts
    processes = run.processes
    steps = training_steps(lengths, tc, processes)
    costs = [
        f"{steps.total:,} steps ({steps.epochs}; {steps.steps_per_epoch:,} an epoch) on {steps.samples:,} samples "
        f"packed into {steps.sequences:,} sequences of at most {tc.max_length:,} tokens, batch {tc.batch_size} a "
        "process"
    ]
    if draft is not None:
        costs.append(draft)
    where = f"torchrun, {processes} processes" if processes > 1 else f"this process on {device_on(tc.device, facts)}"
    plan = PhasePlan(
        "training", status_of(done.draft), f"{tc.draft_architecture} draft, {tc.optimizer}", costs, [where]
    )
    return plan, steps


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


def evaluation_plan(config: PipelineConfig, run: ResolvedRun, heldout: int, done: DonePhases) -> PhasePlan:
    ev = config.evaluation
    cap = ev.max_prompts
    sets = [f"{name} (up to {cap})" if cap else name for name in ev.prompt_sets]
    engines = [f"transformers in this process on {device_on(ev.device, run.facts)} (a)"] if ev.with_transformers else []
    unavailable = served_unavailable(config)
    if unavailable is None:
        what = "server for (b): the target, then target + draft"
        sglang = f"SGLang {what}, tp {config.server.tensor_parallel_size} (evaluation.sglang_python's environment)"
        engines.append(sglang if ev.engine == "sglang" else engine_line(config, run, what))
    else:
        engines.append(f"no served measurement (b): {unavailable}")
    return PhasePlan(
        "evaluation",
        status_of(done.report),
        f"acceptance at k={ev.num_speculative_tokens} on {', '.join(sets)}; {heldout:,} held-out rows",
        [f"up to {ev.max_new_tokens} new tokens a prompt"],
        engines,
    )


def chat_of(target: TargetModel | None) -> ChatTokenizer | None:
    """The target's tokenizer and chat template where its folder holds them (nothing is downloaded)."""
    if target is None or not (target.root_path / "tokenizer_config.json").is_file():
        return None
    return ChatTokenizer(target.root_path)


def known_shape(config: PipelineConfig, target: TargetModel | None) -> tuple[TargetShape | None, str | None]:
    """The target's config.json: from its prepared folder where it is known, else from its reference."""
    if target is not None:
        return folder_shape(target.root_path, str(target.root_path / "config.json")), None
    return shape_of(config)


def plan_run(config: PipelineConfig, facts: DeviceFacts, prompts: list[Prompt] | None = None) -> RunPlan:
    """The plan of `config` on a host with `facts` (see the module docstring)."""
    sc = config.sampling
    prompts = load_prompts(sc.prompt_files, sc.max_prompts) if prompts is None else prompts
    target = known_target(config)
    shape, missing = known_shape(config, target)
    run = resolve_run(config, facts, shape)
    config = run.config
    done = find_done(config, prompts, target)
    size = shape.size if shape else None
    rows = expected_tokens(prompts, sc.responses_per_prompt, sc.max_tokens, chat_of(target), sc.turns)
    if done.samples is not None and done.samples.ok:
        rows = TokenEstimate(
            rows.samples, done.samples.tokens / done.samples.ok, f"the SampleSet in {done.samples.root}"
        )
    kept = [p for p in prompts if not is_heldout(p.id, sc.holdout_fraction)]
    train_rows = share(rows, len(kept) * sc.responses_per_prompt, rows.source)
    validation = sum(is_heldout(f"draft-validation:{p.id}", config.training.holdout_fraction) for p in kept)
    hidden_size = shape.hidden_size if shape else 0
    sampling = sampling_plan(config, run, rows, done)
    memory, memory_problem = memory_line(config, facts, size)
    if memory:
        sampling.costs.append(memory)
    extraction, stored = extraction_plan(config, run, train_rows, hidden_size, done)
    if config.training.data == "online":  # no set is stored: its engine runs beside training
        extraction, stored = PhasePlan("extraction", "skipped (training.data online)", extraction.does), 0
    vocab = PhasePlan(
        "vocab",
        status_of(done.vocab),
        f"counts the trained tokens of {train_rows.samples:,} rows; draft vocabulary {config.vocab.draft_vocab_size:,}",
    )
    trained = (len(kept) - validation) * sc.responses_per_prompt
    planned = target or (shape.planned_target(config.target.model) if shape else None)
    draft, draft_problem = draft_line(config, planned) if planned else (None, None)
    training, steps = training_plan(config, run, [round(train_rows.tokens_per_sample)] * trained, draft, done)
    passes = steps.total / steps.steps_per_epoch if steps.steps_per_epoch else 0.0
    training.costs.append(data_comparison(config, train_rows, hidden_size, passes))
    if config.training.data == "online":
        training.engines.extend(extraction_plan(config, run, train_rows, hidden_size, done)[0].engines)
    phases = [
        prepare_plan(run, done, shape),
        sampling,
        extraction,
        vocab,
        training,
        evaluation_plan(config, run, rows.samples - train_rows.samples, done),
    ]
    found = [missing, memory_problem, draft_problem, run.processes_problem]
    problems = [p for p in found if p] + run_problems(config, facts, planned, prompts)
    to_write = 0 if done.hidden_states else stored
    return RunPlan(facts.describe(), run.server_line(), phases, problems, to_write, run, stored, steps)


def prepare_plan(run: ResolvedRun, done: DonePhases, shape: TargetShape | None) -> PhasePlan:
    size = shape.size if shape else None
    facts = (
        [f"{size.parameters / 1e9:,.2f}B parameters, {gb(size.weight_bytes)} of weights ({size.weight_source}); "
         f"H {shape.hidden_size:,} from {shape.source}"]
        if size and shape
        else []
    )  # fmt: skip
    if done.target is not None:
        source = done.target.source
        where = (
            "in place"
            if source == "local"
            else "converted already"
            if source.startswith("gguf:")
            else "downloaded already"
        )
        return PhasePlan("prepare_target", where, f"{done.target.name} at {done.target.root}", facts)
    reference = run.reference
    does = {
        "embedded": f"converts the embedded {reference.model} GGUF once (one weight load)",
        "hub": f"downloads {reference.hub}'s serving files into the Hub cache (resumes a stopped download)",
    }.get(reference.kind, f"describes {reference.folder} in place")
    return PhasePlan("prepare_target", RUNS, does, facts)


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
