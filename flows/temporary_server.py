"""The temporary Prefect server of an `eagle3 run` without PREFECT_API_URL never outlives its run.

Prefect starts that server (uvicorn, `prefect.server.api.server:create_app`) as a child of the run and
stops it at exit, in an `atexit` hook: a run killed outright (SIGKILL, the OOM killer) never gets there
and the server is orphaned to init for good. Two guards, both set up by `own_temporary_server()` before
the flow starts:
- the server is started here, from the main thread, with a parent-death signal (SIGTERM when the run's
  process dies; `eagle3_core.serving.parent_death`), in place of Prefect's own start (the same command line);
- each started server is recorded (`<PREFECT_HOME>/eagle3-temporary-servers/<pid>.json`) and carries its
  run's identity in its environment (`EAGLE3_SERVER_RUN`: host, pid, start time), and every run first stops
  what a dead run left behind: a recorded or marked server whose run is gone, or an unmarked ephemeral server
  of this PREFECT_HOME orphaned to init (one started before this guard). A server whose run is alive is
  never stopped: in a container where `eagle3 run` is PID 1, its own server's parent is PID 1 too. Each stop
  is a `decision` line in the run's events.jsonl."""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import prefect
import psutil
from prefect.server.api.server import SubprocessASGIServer
from prefect.settings import get_current_settings

from eagle3_core.events import DECISION, RunEvents
from eagle3_core.files import write_text_atomic
from eagle3_core.serving.parent_death import die_with_parent
from tasks.gpu_slot import ProcessIdentity

PHASE = "orchestration"
APP = "prefect.server.api.server:create_app"
RUN_ENV = "EAGLE3_SERVER_RUN"  # the identity of the run that started the server, in the server's environment
STOP_GRACE_S = 10.0


def records_dir() -> Path:
    return Path(get_current_settings().home) / "eagle3-temporary-servers"


class ReapedServer(SubprocessASGIServer):
    """Prefect's temporary server, started with a parent-death signal. Created before Prefect's first API
    call, it is the instance Prefect's `SubprocessASGIServer()` returns (one per port, `None` here)."""

    def _run_uvicorn_command(self) -> subprocess.Popen[Any]:
        # Prefect 3.7.5's own command line and environment (SubprocessASGIServer._run_uvicorn_command).
        server_env = {"PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}
        server_env[RUN_ENV] = json.dumps(vars(ProcessIdentity.current()))
        app_dir = str(prefect.__module_path__.parent)
        uvicorn = ["-m", "uvicorn", "--app-dir", app_dir, "--factory", APP, "--host", "127.0.0.1"]
        return subprocess.Popen(
            args=[sys.executable, *uvicorn, "--port", str(self.port), "--log-level", "error", "--lifespan", "on"],
            env={**os.environ, **server_env, **get_current_settings().to_environment_variables(exclude_unset=True)},
            preexec_fn=die_with_parent(signal.SIGTERM),
        )


def prefect_home_of(env: dict[str, str]) -> Path:
    home = env.get("PREFECT_HOME") or str(Path(env.get("HOME", "~")) / ".prefect")
    return Path(home).expanduser().resolve()


def run_is_gone(marked: str | None, orphaned: bool) -> bool:
    """Whether a server's run is gone: told by the run it names (`RUN_ENV`), else by its re-parenting to init."""
    if marked is None:
        return orphaned
    try:
        return ProcessIdentity(**json.loads(marked)).alive() is False
    except (ValueError, TypeError):
        return orphaned


def is_orphaned_ephemeral_server(process: psutil.Process, home: Path) -> bool:
    """A temporary server of this PREFECT_HOME whose run is gone."""
    try:
        if APP not in " ".join(process.cmdline()):
            return False
        env = process.environ()
        orphaned = process.ppid() == 1
    except (psutil.Error, OSError):
        return False
    mine = env.get("PREFECT__SERVER_EPHEMERAL") == "1" and prefect_home_of(env) == home
    return mine and run_is_gone(env.get(RUN_ENV), orphaned)


def stop_process(process: psutil.Process) -> None:
    try:
        process.terminate()
        process.wait(STOP_GRACE_S)
    except psutil.TimeoutExpired:
        process.kill()
        process.wait(STOP_GRACE_S)
    except psutil.NoSuchProcess:
        pass


def stop_leftover_servers(events: RunEvents) -> list[int]:
    """Stop the temporary servers dead runs left behind (see the module docstring); their pids."""
    stopped: list[int] = []
    home = Path(get_current_settings().home).expanduser().resolve()
    folder = records_dir()
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            record = json.loads(path.read_text())
            server, run = ProcessIdentity(**record["server"]), ProcessIdentity(**record["run"])
        except (OSError, ValueError, TypeError, KeyError):
            path.unlink(missing_ok=True)
            continue
        if server.alive() is False:
            path.unlink(missing_ok=True)
        elif server.alive() and run.alive() is False:
            stop_process(psutil.Process(server.pid))
            stopped.append(server.pid)
            path.unlink(missing_ok=True)
            events.record(
                PHASE,
                DECISION,
                f"stopped the temporary Prefect server pid {server.pid} (port {record.get('port')}) left behind "
                f"by run pid {run.pid}, which is gone",
                server_pid=server.pid,
                run_pid=run.pid,
            )
    for process in psutil.process_iter():
        if process.pid not in stopped and is_orphaned_ephemeral_server(process, home):
            stop_process(process)
            stopped.append(process.pid)
            events.record(
                PHASE,
                DECISION,
                f"stopped the temporary Prefect server pid {process.pid}: orphaned (its run is gone)",
                server_pid=process.pid,
            )
    return stopped


def own_temporary_server(events: RunEvents) -> ReapedServer | None:
    """Without PREFECT_API_URL: stop leftovers, then start this run's temporary server (parent-death
    signal, recorded). With a Prefect server: nothing (None). Call from the main thread, before the flow."""
    if get_current_settings().api.url:
        return None
    stop_leftover_servers(events)
    server = ReapedServer()
    if not isinstance(server, ReapedServer):  # Prefect already started its own: leave it be
        return None
    server.start()
    assert server.server_process is not None
    pid = server.server_process.pid
    path = records_dir() / f"{pid}.json"
    record = {
        "server": vars(ProcessIdentity.of(pid)),
        "run": vars(ProcessIdentity.current()),
        "port": server.port,
    }
    write_text_atomic(path, json.dumps(record))
    atexit.register(path.unlink, missing_ok=True)
    return server
