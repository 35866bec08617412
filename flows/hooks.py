"""Flow-level backstop for engines: when a run is cancelled or crashes (SIGTERM from a worker, a killed
task), stop every server whose pid file is still in the run directory. Phases already stop their own
server in try/finally; this covers the paths where that `finally` never ran."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect.logging import get_logger

from eagle3_core.config import PipelineConfig

logger = get_logger("eagle3.hooks")


def pid_files(run_dir: Path) -> list[Path]:
    """Pid files the serving module writes, one per phase: `<run_dir>/server/<phase>.pid` (and the training
    launch's torchrun agent, `training.pid`)."""
    return sorted((Path(run_dir) / "server").glob("*.pid"))


def stop_engines(flow: Any, flow_run: Any, state: Any) -> None:
    """on_cancellation / on_crashed hook: stop the engines recorded in the run's pid files."""
    from eagle3_core.serving.engine import stop_server

    raw = flow_run.parameters.get("config") or {}
    config = raw if isinstance(raw, PipelineConfig) else PipelineConfig.model_validate(raw)
    for pid_file in pid_files(config.run_dir):
        stopped = stop_server(pid_file, grace_s=config.server.stop_grace_s)
        logger.warning("run %s: stopped engine %s (pids %s)", state.name, pid_file, sorted(stopped))
