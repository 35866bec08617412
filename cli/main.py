"""`eagle3`: the command line. Every command reads the same `PipelineConfig` (`--config`, `--set`)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from contextlib import ExitStack
from contextvars import ContextVar
from pathlib import Path
from typing import Annotated, ParamSpec, TypeVar

import typer
from rich.console import Console

from cli.holds import HELD, hold_gpu_slot, hold_run_dir
from cli.pipeline_group import PipelineCommand, PipelineGroup, print_error, print_warning
from eagle3_core.artifacts import ArtifactInvalid, Manifest, SampleSet, TargetModel
from eagle3_core.config import ConfigError, PipelineConfig, config_warnings, dump_config, load_config
from eagle3_core.devices import DeviceFacts
from eagle3_core.dtypes import dtype_decision, record_dtype_decision
from eagle3_core.events import RunEvents
from eagle3_core.progress import ProgressCallback, ignore_progress
from eagle3_core.resolved_run import resolve_run
from eagle3_core.run_layout import RunLayout

ManifestT = TypeVar("ManifestT", bound=Manifest)
P = ParamSpec("P")
DEBUG: ContextVar[bool] = ContextVar("debug", default=False)  # `--debug`: tracebacks for every failure

app = typer.Typer(
    cls=PipelineGroup, add_completion=False, no_args_is_help=True, help="Train EAGLE-3 drafters end to end."
)
console = Console()

ConfigOption = Annotated[
    Path | None, typer.Option("--config", "-c", help="YAML config file to read (default: every field at its default).")
]
SetOption = Annotated[list[str] | None, typer.Option("--set", "-s", help="Override a field: --set training.lr=3e-4")]


def resolve_config(config: Path | None, overrides: list[str] | None, on_this_host: bool = True) -> PipelineConfig:
    """Load the config or exit with the error that names the field and file; `on_this_host`: the run resolved
    on this host (`eagle3_core.resolved_run`: every `auto` server field a value, sized by the target's config.json).
    Its warnings are shown first."""
    try:
        loaded = load_config(config, overrides or [])
    except ConfigError as exc:
        print_error(str(exc))
        raise typer.Exit(1) from None
    for warning in config_warnings(loaded):
        print_warning(warning)
    return resolve_run(loaded).config if on_this_host else loaded


def run_target(
    cfg: PipelineConfig, dtypes_for: str | None = None, progress: ProgressCallback = ignore_progress
) -> tuple[RunEvents, TargetModel]:
    """The run's event log and its target (a Hub id's download reported to `progress`), resolved before the log
    gets a line: a wrong target leaves no run folder behind. For a phase that runs the target (`dtypes_for`),
    then its compute dtypes line."""
    from eagle3_core.target.prepare import prepare_target

    events = RunEvents(cfg.run_dir)
    target = prepare_target(cfg.target, events, progress)
    if dtypes_for:
        record_dtype_decision(cfg, events, dtypes_for)
        resolve_run(cfg).record(events, dtypes_for)
    return events, target


def load_upstream(kind: type[ManifestT], folder: Path, made_by: str) -> ManifestT:
    """The manifest an earlier phase wrote in `folder`, or exit naming the command that makes it."""
    if not (folder / f"{kind.kind}.json").is_file():
        print_error(f"no {kind.kind}.json in {folder}: run `eagle3 {made_by}` first")
        raise typer.Exit(1)
    try:
        return kind.load(folder)
    except ArtifactInvalid as exc:
        print_error(f"{exc}: run `eagle3 {made_by}` again")
        raise typer.Exit(1) from None


def load_samples(folder: Path) -> SampleSet:
    """The SampleSet in `folder` (`load_upstream`), refused when it holds no ok row: nothing to learn from."""
    sample_set = load_upstream(SampleSet, folder, "sample")
    if sample_set.ok == 0:
        print_error(
            f"{folder}: the SampleSet holds no ok row ({sample_set.error} errors, {sample_set.skipped} skipped): "
            "run `eagle3 sample` again (it retries the errors), or give other prompts"
        )
        raise typer.Exit(1)
    return sample_set


def user_errors() -> tuple[type[BaseException], ...]:
    """Failures the user can act on: a missing or wrong path (a target folder, a draft folder), a setting
    that does not fit the target, a dead or unreachable engine, a failed preflight, a full disk, a bad
    prompt file, shard or manifest, a vocab map of other data, a corrupt config.json or training state, a Hub id
    that cannot be resolved, a Hub push without token or repo, the GPU slot's lease lost (the Prefect server
    unreachable or the lease revoked: the phase stopped, its work kept). Everything else is a bug: a traceback."""
    from eagle3_core.files import DiskFullError, UnreadableFile
    from eagle3_core.hidden_states.storage import ShardError
    from eagle3_core.preflight import PreflightError
    from eagle3_core.release.hub import HubError
    from eagle3_core.run_lock import RunDirBusy
    from eagle3_core.sampling.prompts import PromptFileError
    from eagle3_core.serving.engine import ServerError
    from eagle3_core.target.hub import HubTargetError
    from eagle3_core.vocab import StaleVocabMap
    from tasks.gpu_slot import SlotLost

    paths = (FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError)
    return (*paths, ConfigError, PromptFileError, ServerError, PreflightError, DiskFullError, ShardError,
            ArtifactInvalid, StaleVocabMap, UnreadableFile, HubTargetError, HubError, RunDirBusy, SlotLost)  # fmt: skip


def command(name: str) -> Callable[[Callable[P, None]], Callable[P, None]]:
    """`app.command(name)` with the one prologue every command shares: a failure the user can act on ends
    it with one `error:` line and exit status 1 (the work already on disk is kept; the same command
    resumes after it), unless `--debug` asks for the traceback; what the command holds (`hold_run_dir`) is
    released when it ends."""

    def register(function: Callable[P, None]) -> Callable[P, None]:
        @functools.wraps(function)
        def run(*args: P.args, **kwargs: P.kwargs) -> None:
            with ExitStack() as held:
                HELD.set(held)
                try:
                    function(*args, **kwargs)
                except user_errors() as exc:
                    if DEBUG.get():
                        raise
                    print_error(str(exc))
                    raise typer.Exit(1) from None

        return app.command(name, cls=PipelineCommand)(run)

    return register


@app.callback()
def main(
    verbose: Annotated[
        bool, typer.Option("--verbose", "-v", help="Log debug messages too, not only progress and decisions.")
    ] = False,
    debug: Annotated[bool, typer.Option("--debug", help="Show the traceback of every failure.")] = False,
) -> None:
    DEBUG.set(debug)
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S"
    )


@command("config")
def show_config(
    config: ConfigOption = None,
    set_: SetOption = None,
    explain: Annotated[
        bool,
        typer.Option(
            "--explain", help="Comment every field with its description and its role in each phase that reads it."
        ),
    ] = False,
) -> None:
    """Print the resolved configuration as YAML, and what each `auto` compute dtype and server field stands
    for here."""
    from cli.explain import explained_yaml

    cfg = resolve_config(config, set_, on_this_host=False)
    text = explained_yaml(cfg) if explain else dump_config(cfg)
    console.print(text, highlight=False, markup=False, soft_wrap=True)  # YAML to copy: never wrapped
    console.print(f"# {dtype_decision(cfg)[0]}", highlight=False, markup=False, soft_wrap=True)
    console.print(f"# {resolve_run(cfg).server_line()}", highlight=False, markup=False, soft_wrap=True)


@command("prepare-target")
def prepare_target_command(
    model: Annotated[
        str | None, typer.Argument(help="Embedded target name, a local HF folder, or a Hub id org/name[@revision].")
    ] = None,
    config: ConfigOption = None,
    set_: SetOption = None,
) -> None:
    """Convert the embedded target (once), describe a local folder, or download a Hub id's serving files into
    the Hub cache (resuming a stopped download), and print its manifest."""
    from eagle3_core.progress import rich_progress

    cfg = resolve_config(config, (set_ or []) + ([f"target.model={model}"] if model else []))
    hold_run_dir(cfg)
    with rich_progress() as progress:
        _, target = run_target(cfg, progress=progress)
    console.print(target.model_dump_json(indent=2, exclude={"files"}), highlight=False, markup=False)


@command("run")
def run_command(
    config: ConfigOption = None,
    set_: SetOption = None,
    nightly: Annotated[
        bool, typer.Option("--nightly", help="Run nightly-regenerate (warm start, keep the better drafter).")
    ] = False,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print the plan (`eagle3 plan`) and stop: no run folder, no engine.")
    ] = False,
) -> None:
    """Run the whole flow locally through Prefect (ephemeral by default, or the server at PREFECT_API_URL);
    completed phases return from cache. Prints the run summary and the acceptance report."""
    import os
    import signal
    import sys
    import time

    if dry_run:
        print_plan(resolve_config(config, set_, on_this_host=False), None)
        return
    cfg = resolve_config(config, set_)
    hold_run_dir(cfg)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per Prefect API call otherwise
    # The ephemeral API server gets 20 s to start by default: too little on a busy 2-core machine.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    # Prefect turns SIGTERM into a crash of the running task, then re-delivers it to the handler it found:
    # with the default one the process dies at once, the flow run stays Running and no on_crashed hook
    # stops the engines. Exiting via SystemExit lets the flow engine record the crash and run its hooks.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    from flows.temporary_server import own_temporary_server

    own_temporary_server(RunEvents(cfg.run_dir))  # ephemeral mode: a server that dies with this process
    start = time.monotonic()
    if nightly:
        from flows.regenerate import regenerate as flow_function
    else:
        from flows.train_drafter import train_drafter as flow_function
    report = flow_function(cfg)
    summary = RunLayout.of(cfg).summary_markdown.read_text()
    text = "\n".join(line for line in summary.splitlines() if "](data:image/" not in line)  # plots: files
    console.print(text, highlight=False, markup=False)
    console.print(
        f"acceptance length {report.acceptance_length:.3f} at k={report.num_speculative_tokens}; "
        f"flow wall time {time.monotonic() - start:.1f} s",
        highlight=False,
    )


@command("deploy")
def deploy_command(
    gpu_slots: Annotated[int, typer.Option(help="Slots of the `gpu` concurrency limit when created.")] = 1,
) -> None:
    """Create the `gpu` process work pool and concurrency limit, and register the deployments of
    prefect.yaml (train-drafter on demand, nightly-regenerate at 02:00 UTC) on the PREFECT_API_URL server."""
    from deployments.setup import set_up

    console.print(set_up(gpu_slots), highlight=False)


@command("extract")
def extract_command(
    samples: Annotated[
        Path | None, typer.Option("--samples", help="SampleSet folder (default: <run_dir>/samples).")
    ] = None,
    config: ConfigOption = None,
    set_: SetOption = None,
) -> None:
    """Extract hidden states of the sampled conversations (resumes per shard), with weight-load, sample,
    tokens/s and shard progress; prints the HiddenStateSet manifest."""
    from eagle3_core.extraction.phase import extract_hidden_states
    from eagle3_core.progress import rich_progress

    cfg = resolve_config(config, set_)
    hold_run_dir(cfg)
    sample_set = load_samples(samples or RunLayout.of(cfg).samples)
    events, target = run_target(cfg, "extraction")
    hold_gpu_slot(cfg, events, "extraction")
    with rich_progress() as progress:
        hidden = extract_hidden_states(cfg, sample_set, target, events, progress=progress)
    console.print(hidden.model_dump_json(indent=2, exclude={"files"}), highlight=False, markup=False)


@command("evaluate")
def evaluate_command(
    draft: Annotated[
        Path | None, typer.Option("--draft", help="Draft checkpoint or export folder (default: <run_dir>/draft).")
    ] = None,
    config: ConfigOption = None,
    set_: SetOption = None,
) -> None:
    """Measure the draft's acceptance on held-out prompts, in transformers and served (evaluation.engine: vLLM or
    SGLang); writes
    <run_dir>/eval/ (report.md, acceptance.png, eval_report.json). Exits 1 if the acceptance guard fails."""
    from eagle3_core.evaluation.phase import checkpoint_of, evaluate_draft
    from eagle3_core.evaluation.report import AcceptanceBelowFloor
    from eagle3_core.progress import rich_progress

    cfg = resolve_config(config, set_)
    hold_run_dir(cfg)
    checkpoint = checkpoint_of(draft or RunLayout.of(cfg).draft.root)
    sample_dir = RunLayout.of(cfg).samples
    sample_set = SampleSet.load(sample_dir) if (sample_dir / f"{SampleSet.kind}.json").is_file() else None
    events, target = run_target(cfg, "evaluation")
    hold_gpu_slot(cfg, events, "evaluation")
    if sample_set is None:
        console.print(f"[yellow]no SampleSet in {sample_dir}: measuring HumanEval only[/yellow]")
    try:
        with rich_progress() as progress:
            report = evaluate_draft(cfg, checkpoint, target, sample_set, events, progress=progress)
    except AcceptanceBelowFloor as exc:
        console.print(f"[red]acceptance guard failed:[/red] {exc}", highlight=False, markup=False)
        raise typer.Exit(1) from None
    console.print(
        f"tau (a) at k={report.num_speculative_tokens}: {report.acceptance_length:.3f}, per position "
        f"{[round(r, 3) for r in report.per_position]}; (b) {cfg.evaluation.engine}: {report.vllm_acceptance_length}; "
        f"speedup at batch 1: {report.speedup}; report: {report.root_path / 'report.md'}",
        highlight=False,
        markup=False,
    )


@command("sample")
def sample_command(config: ConfigOption = None, set_: SetOption = None) -> None:
    """Sample the target's answers to the prompts (starting and stopping a vLLM server, or using
    server.url); resumes by prompt id. Writes <run_dir>/samples/ and prints the accounting."""
    from eagle3_core.progress import rich_progress
    from eagle3_core.sampling.phase import sample_prompts

    cfg = resolve_config(config, set_)
    hold_run_dir(cfg)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one log line per request otherwise
    events, target = run_target(cfg, "sampling")
    hold_gpu_slot(cfg, events, "sampling")
    with rich_progress() as progress:
        sample_set = sample_prompts(cfg, target, events, progress=progress)
    each = f" x {sample_set.responses_per_prompt} responses" if sample_set.responses_per_prompt > 1 else ""
    console.print(
        f"{sample_set.prompts} prompts{each}: {sample_set.ok} ok, {sample_set.error} errors, {sample_set.skipped} "
        f"skipped; {sample_set.tokens} tokens ({sample_set.loss_tokens} trained); {sample_set.root}",
        highlight=False,
        markup=False,
    )
    for sample, reason in list(sample_set.errors.items())[:5]:
        console.print(f"  error {sample}: {reason}", highlight=False, markup=False)


@command("vocab")
def vocab_command(
    samples: Annotated[
        Path | None, typer.Option("--samples", help="SampleSet folder (default: <run_dir>/samples).")
    ] = None,
    config: ConfigOption = None,
    set_: SetOption = None,
) -> None:
    """Build the draft vocabulary from loss-masked tokens of the training rows (reused only for the same
    SampleSet); prints its size and coverage."""
    from eagle3_core.vocab import build_vocab_map

    cfg = resolve_config(config, set_)
    hold_run_dir(cfg)
    sample_set = load_samples(samples or RunLayout.of(cfg).samples)
    events, target = run_target(cfg)
    vocab_map = build_vocab_map(cfg, sample_set, target, events)
    console.print(
        f"draft vocabulary {vocab_map.draft_vocab_size} of {vocab_map.target_vocab_size} tokens, coverage "
        f"{vocab_map.coverage:.2%}; {vocab_map.root}",
        highlight=False,
    )


@command("train")
def train_command(
    hidden_states: Annotated[
        Path | None, typer.Option("--hidden-states", help="HiddenStateSet folder (default: <run_dir>/hidden_states).")
    ] = None,
    vocab: Annotated[Path | None, typer.Option("--vocab", help="VocabMap folder (default: <run_dir>/vocab).")] = None,
    config: ConfigOption = None,
    set_: SetOption = None,
) -> None:
    """Train the draft on <run_dir>/hidden_states with <run_dir>/vocab (resumes from the newest training
    state); exports the vLLM-loadable folder to <run_dir>/draft/export. Under torchrun: one process per GPU
    (the flow's training task launches it so for training.processes > 1); a failing rank's error is recorded
    for torchrun."""
    import os

    from torch.distributed.elastic.multiprocessing.errors import record

    from eagle3_core.artifacts import HiddenStateSet, VocabMap
    from eagle3_core.progress import rich_progress
    from eagle3_core.training.launch import launched_rank
    from eagle3_core.training.phase import train_draft

    cfg = resolve_config(config, set_)
    if int(os.environ.get("RANK", "0")) == 0:  # the other ranks of a torchrun write under rank 0's lock
        hold_run_dir(cfg)
    layout = RunLayout.of(cfg)
    hidden = load_upstream(HiddenStateSet, hidden_states or layout.hidden_states, "extract")
    vocab_map = load_upstream(VocabMap, vocab or layout.vocab, "vocab")
    events, target = run_target(cfg)
    if int(os.environ.get("RANK", "0")) == 0:
        hold_gpu_slot(cfg, events, "training")
    with launched_rank() or rich_progress() as progress:
        checkpoint = record(train_draft)(cfg, hidden, vocab_map, target, events, progress=progress)
    metrics = {k: round(v, 4) for k, v in checkpoint.metrics.items() if k.startswith(("val_", "initial_val_top1"))}
    console.print(f"trained {checkpoint.step} steps; {metrics}; {checkpoint.path_of('export')}", highlight=False)


@command("export")
def export_command(
    out: Annotated[
        Path | None, typer.Option("--out", help="Folder to write config.json + model.safetensors to.")
    ] = None,
    state: Annotated[Path | None, typer.Option("--state", help="Training state file (default: the newest).")] = None,
    push_to_hub: Annotated[
        str | None, typer.Option("--push-to-hub", help="Publish the folder as this Hub model repo (org/name).")
    ] = None,
    config: ConfigOption = None,
    set_: SetOption = None,
) -> None:
    """Export a training state (e.g. an intermediate step) as an EAGLE-3 folder vLLM and SGLang load, with its
    model card; `--push-to-hub org/name` publishes it (without --out: the run's <run_dir>/draft/export), the
    token from HF_TOKEN."""
    from eagle3_core.artifacts import DraftCheckpoint, HiddenStateSet, VocabMap
    from eagle3_core.release.card import write_model_card
    from eagle3_core.release.hub import check_repo_id, hub_token, push_folder
    from eagle3_core.training.phase import export_training_state

    if out is None and push_to_hub is None:
        print_error("give --out DIR (export a training state) or --push-to-hub org/name")
        raise typer.Exit(1)
    if push_to_hub is not None:  # before anything is written
        check_repo_id(push_to_hub)
        hub_token()
    cfg = resolve_config(config, set_)
    hold_run_dir(cfg)
    layout = RunLayout.of(cfg)
    _, target = run_target(cfg)
    folder = out or layout.draft.export
    if out is not None:
        hidden = load_upstream(HiddenStateSet, layout.hidden_states, "extract")
        vocab_map = load_upstream(VocabMap, layout.vocab, "vocab")
        paths = export_training_state(cfg, hidden, vocab_map, target, out, state)
        console.print(f"wrote {', '.join(str(p) for p in paths)}", highlight=False)
        if push_to_hub is None and not (layout.draft.root / f"{DraftCheckpoint.kind}.json").is_file():
            console.print("no model card: training has not finished (its card needs the run's draft checkpoint)")
            return
    checkpoint = load_upstream(DraftCheckpoint, layout.draft.root, "train")
    if out is not None:
        checkpoint = DraftCheckpoint(root=str(out.resolve()), step=checkpoint.step, config=checkpoint.config)
    card = write_model_card(cfg, target, checkpoint, folder, push_to_hub)
    console.print(f"model card {card}", highlight=False, soft_wrap=True)
    if push_to_hub is not None:
        url = push_folder(folder, push_to_hub)
        console.print(f"published {folder} to {push_to_hub}: {url}", highlight=False, soft_wrap=True)


@command("serve")
def serve_command(
    draft: Annotated[
        Path | None, typer.Option("--draft", help="Draft folder or export folder (default: <run_dir>/draft).")
    ] = None,
    engine: Annotated[str, typer.Option("--engine", help="vllm or sglang.")] = "vllm",
    port: Annotated[int | None, typer.Option("--port", help="Port (default: server.port; 0 picks one).")] = None,
    k: Annotated[
        int | None, typer.Option("--k", help="Draft tokens per step (default: the fastest the evaluation found).")
    ] = None,
    config: ConfigOption = None,
    set_: SetOption = None,
) -> None:
    """Serve the target with the run's exported draft as its EAGLE-3 speculator (server.* settings, loopback,
    the API key of server.api_key_env) until Ctrl-C. Prints the equivalent command and keeps it beside the
    draft as serve-<engine>.sh."""
    import signal
    import sys

    from eagle3_core.progress import rich_progress
    from eagle3_core.release.serve import (
        engine_server,
        export_folder,
        keep_script,
        plan,
        record_plan,
        serve_dir,
        wait_until_dead,
    )

    if engine not in ("vllm", "sglang"):
        print_error(f"--engine {engine!r}: vllm or sglang")
        raise typer.Exit(1)
    cfg = resolve_config(config, (set_ or []) + ([f"server.port={port}"] if port is not None else []))
    hold_run_dir(cfg, serve_dir(cfg))  # one `eagle3 serve` a run folder, beside its phases
    export_dir = export_folder(draft or RunLayout.of(cfg).draft.root)
    events, target = run_target(cfg)
    cfg, served = plan(cfg, engine, target.root_path, export_dir, k)  # type: ignore[arg-type]
    record_plan(events, served, export_dir)
    script = keep_script(served, target.root_path, export_dir)
    text = f"{served.choice.reason}\n{served.command.shell()}\n(kept as {script})"
    console.print(text, highlight=False, markup=False, soft_wrap=True)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # stops the engine on the way out
    # Ctrl-C stops it even where SIGINT came ignored (a shell starts its background jobs so, and Python then
    # leaves KeyboardInterrupt off).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    with rich_progress() as progress:
        server = engine_server(cfg, served, target.root_path, export_dir, events, progress).start()
    try:
        console.print(f"serving at {server.base_url}/v1 (Ctrl-C stops it)", highlight=False)
        wait_until_dead(server)
    except KeyboardInterrupt:
        console.print("stopping", highlight=False)
    finally:
        server.stop()


GpusOption = Annotated[int | None, typer.Option("--gpus", help="Plan for a host of this many GPUs (0: CPU only).")]
GpuMemoryOption = Annotated[float, typer.Option("--gpu-memory-gib", help="Memory of each assumed GPU, GiB.")]
GpuNameOption = Annotated[str | None, typer.Option("--gpu-name", help="Name of the assumed GPUs.")]


def print_plan(cfg: PipelineConfig, facts: DeviceFacts | None) -> None:
    """Print the plan of `cfg` on `facts` (None: this host); its problems end the command with status 1."""
    from eagle3_core.devices import host_facts
    from eagle3_core.planning.plan import plan_run, render_plan

    plan = plan_run(cfg, facts or host_facts())
    console.print(render_plan(plan, cfg.run_dir), highlight=False, markup=False, soft_wrap=True)
    if plan.problems:
        raise typer.Exit(1)


@command("plan")
def plan_command(
    config: ConfigOption = None,
    set_: SetOption = None,
    gpus: GpusOption = None,
    gpu_memory_gib: GpuMemoryOption = 80.0,
    gpu_name: GpuNameOption = None,
) -> None:
    """Print what each phase would do and cost (tokens, hidden-state disk, GPU memory a rank, training steps,
    engines) and which are already done, without loading a weight or writing anything; on this host, or on
    an assumed one (--gpus 8 --gpu-memory-gib 80). Exits 1 when the plan does not fit."""
    from eagle3_core.devices import assumed_facts

    cfg = resolve_config(config, set_, on_this_host=False)
    print_plan(cfg, assumed_facts(gpus, gpu_memory_gib, gpu_name) if gpus is not None else None)


@command("doctor")
def doctor_command(config: ConfigOption = None, set_: SetOption = None) -> None:
    """Check this host against what a config needs (GPUs, driver, torch and its CUDA, vLLM and SGLang
    versions, bf16, disk at run_dir for the hidden states, the Prefect API at PREFECT_API_URL); one line a
    check, each failure with its fix; exits 1 when any fails."""
    from eagle3_core.devices import host_facts
    from eagle3_core.doctor import doctor_checks, gather_host_facts, needs_of, plan_checks, render_checks
    from eagle3_core.planning.plan import plan_run

    devices = host_facts()
    cfg = resolve_config(config, set_, on_this_host=False) if config or set_ else None
    plan = plan_run(cfg, devices) if cfg else None
    needs = needs_of(plan.run, plan.hidden_state_bytes) if plan else None
    facts = gather_host_facts(devices, cfg.run_dir if cfg else None, cfg.evaluation.sglang_python if cfg else None)
    checks = doctor_checks(facts, needs) + (plan_checks(plan.problems) if plan else [])
    console.print(render_checks(checks), highlight=False, markup=False, soft_wrap=True)
    if not all(check.ok for check in checks):
        raise typer.Exit(1)
