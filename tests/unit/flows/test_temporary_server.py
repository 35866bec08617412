"""A run stops the temporary Prefect servers a killed run left behind (`flows.temporary_server`): one
orphaned to init of this PREFECT_HOME, and one on record whose run is gone; never one of another
PREFECT_HOME. (That a killed run's own server dies with it: tests/unit/tasks/gpu_slot/test_gpu_slot_leases.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
from prefect.settings import PREFECT_HOME, temporary_settings

from eagle3_core.events import RunEvents
from flows.temporary_server import APP, RUN_ENV, records_dir, stop_leftover_servers
from tasks.gpu_slot import ProcessIdentity
from tests.helpers.processes import dead_pid, decisions


def orphan(command: list[str], env: dict[str, str]) -> psutil.Process:
    """A process re-parented to init: started by a parent that exits at once."""
    launcher = (
        "import subprocess, sys, json\n"
        f"p = subprocess.Popen({command!r}, env=json.loads(sys.argv[1]), start_new_session=True,\n"
        "                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
        "print(p.pid, flush=True)\n"
    )
    out = subprocess.run([sys.executable, "-c", launcher, json.dumps(env)], capture_output=True, text=True, check=True)
    process = psutil.Process(int(out.stdout))
    deadline = time.monotonic() + 10
    while process.ppid() != 1:
        assert time.monotonic() < deadline, "not re-parented to init (a subreaper?)"
        time.sleep(0.1)
    return process


def test_a_run_stops_the_temporary_servers_a_killed_run_left_behind(tmp_path: Path):
    home = (tmp_path / "prefect-home").resolve()
    fake_server = [sys.executable, "-c", "import time; time.sleep(600)", APP]
    # An orphan of this PREFECT_HOME (a run killed before this guard), one of another home, and a
    # recorded server whose run is gone.
    mine = orphan(fake_server, {**os.environ, "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT_HOME": str(home)})
    other_home = {**os.environ, "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT_HOME": str(tmp_path / "other")}
    theirs = orphan(fake_server, other_home)
    recorded = subprocess.Popen(fake_server)
    events = RunEvents(tmp_path / "run")
    try:
        with temporary_settings({PREFECT_HOME: str(home)}):
            folder = records_dir()
            folder.mkdir(parents=True)
            run = {"host": ProcessIdentity.current().host, "pid": dead_pid(), "started": time.time() - 60}
            record = {"server": vars(ProcessIdentity.of(recorded.pid)), "run": run, "port": 8123}
            (folder / f"{recorded.pid}.json").write_text(json.dumps(record))
            stopped = stop_leftover_servers(events)
        assert sorted(stopped) == sorted([mine.pid, recorded.pid])
        recorded.wait(timeout=15)  # stopped (reaped by the stopper: its exit status is not ours to read)
        mine.wait(timeout=15)
        assert theirs.is_running(), "a server of another PREFECT_HOME is not ours to stop"
        assert not list(folder.glob("*.json"))
        messages = [e["message"] for e in decisions(tmp_path / "run")]
        assert len(messages) == 2 and all("stopped the temporary Prefect server" in m for m in messages)
    finally:
        for process in (mine, theirs, psutil.Process(recorded.pid) if recorded.poll() is None else None):
            if process is not None and process.is_running():
                process.kill()


def test_a_server_whose_run_is_alive_is_never_stopped_even_re_parented_to_init(tmp_path: Path):
    """In a container where `eagle3 run` is PID 1, its temporary server's parent is PID 1, as an orphan's is:
    a second run tells them apart by the run the server names, and stops only the dead run's."""
    home = (tmp_path / "prefect-home").resolve()
    fake_server = [sys.executable, "-c", "import time; time.sleep(600)", APP]
    env = {**os.environ, "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT_HOME": str(home)}
    live_run = json.dumps(vars(ProcessIdentity.current()))
    dead_run = json.dumps({"host": ProcessIdentity.current().host, "pid": dead_pid(), "started": time.time() - 60})
    first = orphan(fake_server, {**env, RUN_ENV: live_run})
    dead = orphan(fake_server, {**env, RUN_ENV: dead_run})
    try:
        with temporary_settings({PREFECT_HOME: str(home)}):
            stopped = stop_leftover_servers(RunEvents(tmp_path / "run"))
        assert stopped == [dead.pid]
        assert first.is_running(), "the live run's temporary server was stopped"
    finally:
        for process in (first, dead):
            if process.is_running():
                process.kill()
