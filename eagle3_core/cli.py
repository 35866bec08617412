"""`eagle3`: the command line. Every command reads the same `PipelineConfig` (`--config`, `--set`)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from eagle3_core.config import ConfigError, PipelineConfig, dump_config, load_config
from eagle3_core.events import RunEvents

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Train EAGLE-3 drafters end to end.")
console = Console()

ConfigOption = Annotated[Path | None, typer.Option("--config", "-c", help="YAML config file.")]
SetOption = Annotated[
    list[str] | None, typer.Option("--set", "-s", help="Override a field: --set training.lr=3e-4")
]


def resolve_config(config: Path | None, overrides: list[str] | None) -> PipelineConfig:
    """Load the config or exit with the error that names the field and file."""
    try:
        return load_config(config, overrides or [])
    except ConfigError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from None


def run_events(cfg: PipelineConfig) -> RunEvents:
    return RunEvents(cfg.run_dir)


@app.callback()
def main(verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Debug logging.")] = False) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S"
    )


@app.command("config")
def show_config(config: ConfigOption = None, set_: SetOption = None) -> None:
    """Print the resolved configuration as YAML."""
    console.print(dump_config(resolve_config(config, set_)), highlight=False, markup=False)


@app.command("prepare-target")
def prepare_target_command(
    model: Annotated[str | None, typer.Argument(help="Embedded target name or a local HF folder.")] = None,
    config: ConfigOption = None,
    set_: SetOption = None,
) -> None:
    """Convert the embedded target (once) or describe a local folder, and print its manifest."""
    from eagle3_core.target import prepare_target

    cfg = resolve_config(config, (set_ or []) + ([f"target.model={model}"] if model else []))
    target = prepare_target(cfg.target, run_events(cfg))
    console.print(target.model_dump_json(indent=2, exclude={"files"}), highlight=False, markup=False)
