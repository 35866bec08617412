"""`eagle3 serve`: the target served with the run's exported draft as its EAGLE-3 speculator, in the foreground
until Ctrl-C, by the same lifecycle the phases start their engines with (`serving.lifecycle.EngineServer`:
weight-load progress from the engine's log, fail-fast on a dead or stalled start, nothing left on stop).

The server runs under `<run_dir>/serve/` (its pid file and log), so starting it stops only a server an earlier
`eagle3 serve` of this run left behind, never a phase's engine of a run in progress.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from eagle3_core.artifacts import DraftCheckpoint
from eagle3_core.config import PipelineConfig
from eagle3_core.draft.export import sglang_refusal
from eagle3_core.events import DECISION, RunEvents
from eagle3_core.files import write_text_atomic
from eagle3_core.progress import ProgressCallback
from eagle3_core.release.card import report_of
from eagle3_core.release.commands import Engine, KChoice, ServeCommand, fastest_k, script_path, serve_command
from eagle3_core.run_layout import DraftLayout, RunLayout
from eagle3_core.serving.engine import EngineDied, ServerError, VllmServer, free_port, speculative_args
from eagle3_core.serving.lifecycle import EngineServer
from eagle3_core.serving.sglang import SglangServer, sglang_launch, speculative_flags

PHASE = "serve"
POLL_S = 1.0


def serve_dir(config: PipelineConfig) -> Path:
    """`<run_dir>/serve/`: the served engine's pid file and log, and the lock that keeps one `eagle3 serve` a run
    folder (the run's own phases write beside it)."""
    return Path(config.run_dir) / PHASE


def export_folder(draft: Path) -> Path:
    """The loadable folder of `draft`: a training run's draft folder (its `export/`) or an export folder."""
    for folder in (DraftLayout(draft).export, draft):
        if (folder / "config.json").is_file() and (folder / "model.safetensors").is_file():
            return folder
    raise FileNotFoundError(f"{draft}: no exported draft (config.json + model.safetensors, or export/ with them)")


def k_to_serve(config: PipelineConfig, export_dir: Path) -> KChoice:
    """`fastest_k` of the run's evaluation report where it measured this draft (the draft folder above
    `export_dir` is the checkpoint it evaluated), else the default."""
    checkpoint = DraftCheckpoint.load_valid(export_dir.parent)
    return fastest_k(report_of(RunLayout.of(config).eval, checkpoint) if checkpoint is not None else None)


@dataclass(frozen=True)
class Served:
    """What `eagle3 serve` serves: the command (its port fixed), the k and why, and the script it keeps."""

    command: ServeCommand
    choice: KChoice
    script: Path


def plan(
    config: PipelineConfig, engine: Engine, target_dir: Path, export_dir: Path, k: int | None = None
) -> tuple[PipelineConfig, Served]:
    """The config with its port fixed (0 picks a free one now, so the printed command names it) and what to
    serve; refuses a draft SGLang would serve as another layer, and an API key SGLang would show in `ps`."""
    if engine == "sglang":
        if (refusal := sglang_refusal(export_dir)) is not None:
            raise ServerError(refusal)
        if config.server.api_key_variable():
            raise ServerError(
                "SGLang takes its API key only as --api-key on its command line (seen in ps and the events): "
                "serve with --engine vllm (VLLM_API_KEY from the environment), or unset server.api_key_env"
            )
    port = config.server.port or free_port(config.server.host)
    config = config.model_copy(update={"server": config.server.model_copy(update={"port": port})})
    choice = k_to_serve(config, export_dir) if k is None else KChoice(k, f"k = {k}: given")
    command = serve_command(config, engine, target_dir, export_dir, choice.k, port)
    return config, Served(command, choice, script_path(export_dir, engine))


def keep_script(served: Served, target_dir: Path, export_dir: Path) -> Path:
    """Write the command as `serve-<engine>.sh` beside the draft (atomically, executable)."""
    comment = (
        f"Serves {target_dir} with the EAGLE-3 draft {export_dir} ({served.choice.reason}).\n"
        "Written by `eagle3 serve`; the API key, if any, is read from the variable named here."
    )
    write_text_atomic(served.script, served.command.script(comment))
    served.script.chmod(0o755)
    return served.script


def engine_server(
    config: PipelineConfig,
    served: Served,
    target_dir: Path,
    export_dir: Path,
    events: RunEvents,
    progress: ProgressCallback,
) -> EngineServer:
    """The server of `served.command`, not yet started; its argv is the command's (`test_serve` checks)."""
    run_dir = serve_dir(config)
    k = served.choice.k
    if served.command.engine == "vllm":
        extra = speculative_args(export_dir, k, config.server.extra_args)
        return VllmServer(config.server, target_dir, run_dir, events, progress, extra, phase=PHASE)
    extra = config.evaluation.sglang_args + speculative_flags(export_dir, k)
    launch = sglang_launch(config.evaluation)
    return SglangServer(launch, config.server, target_dir, run_dir, events, progress, extra, phase=PHASE)


def record_plan(events: RunEvents, served: Served, export_dir: Path) -> None:
    events.record(PHASE, DECISION, f"serving {export_dir} in {served.command.engine}: {served.choice.reason}",
                  k=served.choice.k, script=str(served.script))  # fmt: skip


def wait_until_dead(server: EngineServer) -> None:
    """Block while the engine runs; when it dies, raise `EngineDied` with how it ended and its log's tail."""
    while (report := server.exit_report(POLL_S)) is None:
        continue
    raise EngineDied(report)
