"""Flow-level backstop for engines: when a run is cancelled or crashes (SIGTERM from a worker, a killed
task), stop every server whose pid file is still in the run directory and whose owner is this process or
gone (`eagle3_core.serving.processes.stop_server`): another live run's engine is never touched. Phases
already stop their own server in try/finally; this covers the paths where that `finally` never ran."""

from __future__ import annotations

from typing import Any

from prefect.logging import get_logger

from eagle3_core.config import PipelineConfig
from eagle3_core.run_layout import RunLayout

logger = get_logger("eagle3.hooks")


def stop_engines(flow: Any, flow_run: Any, state: Any) -> None:
    """on_cancellation / on_crashed hook: stop the engines recorded in the run's pid files (a live owner's
    excepted)."""
    from eagle3_core.serving.engine import stop_server

    raw = flow_run.parameters.get("config") or {}
    config = raw if isinstance(raw, PipelineConfig) else PipelineConfig.model_validate(raw)
    for pid_file in RunLayout.of(config).pid_files():
        stopped = stop_server(pid_file, grace_s=config.server.stop_grace_s)
        if stopped:
            logger.warning("run %s: stopped engine %s (pids %s)", state.name, pid_file, sorted(stopped))
