"""The flow's crash/cancel hook stops what a pid file in the run directory names: a real process group
(a stand-in for a vLLM server and its workers), stopped through eagle3_core.serving.engine.stop_server."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import psutil

from eagle3_core.config import PipelineConfig
from eagle3_core.run_layout import RunLayout
from eagle3_core.serving.processes import write_pid_file
from flows.hooks import stop_engines
from tasks.hosts import on_host
from tests.helpers.processes import owned_engine

PARENT_WITH_CHILD = (
    "import subprocess, sys, time; "
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)']); time.sleep(300)"
)


def test_crash_hook_stops_the_engine_named_by_the_pid_file(tmp_path: Path):
    config = PipelineConfig(run_dir=tmp_path / "run")
    engine = subprocess.Popen([sys.executable, "-c", PARENT_WITH_CHILD], start_new_session=True)
    try:
        process = psutil.Process(engine.pid)
        while not process.children():
            time.sleep(0.05)
        child = process.children()[0]
        pid_file = config.run_dir / "server" / "sampling.pid"
        pid_file.parent.mkdir(parents=True)
        pid_file.write_text(json.dumps({"pid": engine.pid, "pgid": engine.pid, "started": process.create_time()}))
        flow_run = SimpleNamespace(parameters={"config": config.model_dump(mode="json")})
        stop_engines(None, flow_run, SimpleNamespace(name="Crashed"))
        engine.wait(timeout=30)
        child.wait(timeout=30)
        assert not pid_file.exists()
    finally:
        if engine.poll() is None:
            engine.kill()


def sleeper(pid_file: Path, host: str | None = None) -> subprocess.Popen:
    """A process in a session of its own, recorded in `pid_file` as an engine records itself (by another
    host's name when `host` is given)."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
    pid_file.parent.mkdir(parents=True, exist_ok=True)
    write_pid_file(pid_file, process.pid)
    if host is not None:
        pid_file.write_text(json.dumps({**json.loads(pid_file.read_text()), "host": host}))
    return process


def crash(config: PipelineConfig) -> None:
    stop_engines(
        None, SimpleNamespace(parameters={"config": config.model_dump(mode="json")}), SimpleNamespace(name="Crashed")
    )


def test_a_hosts_crash_hook_stops_its_slices_engines_only(tmp_path: Path):
    """Hosts share `<run_dir>/server/`: the crash hook of host 0's child run stops host 0's engine and leaves
    host 1's (and its pid file) alone; the parent run's hook (no slice) stops neither; and a pid file written
    on another host is never acted on here, as its pid names another machine's process."""
    config = PipelineConfig(run_dir=tmp_path / "run", orchestration={"hosts": 2})
    host0, host1 = (RunLayout.of(on_host(config, i)) for i in (0, 1))
    elsewhere = RunLayout(config.run_dir).pid_file("evaluation")
    engines = [
        sleeper(host0.pid_file("sampling")),
        sleeper(host1.pid_file("sampling")),
        sleeper(elsewhere, "gpu-host-9"),
    ]
    try:
        crash(config)  # the parent's hook
        assert all(engine.poll() is None for engine in engines[:2])
        crash(on_host(config, 0))
        assert engines[0].wait(timeout=30) is not None and not host0.pid_file("sampling").exists()
        assert engines[1].poll() is None and host1.pid_files() == [host1.pid_file("sampling")]
        crash(config)
        assert engines[2].poll() is None and elsewhere.exists()
        crash(on_host(config, 1))
        assert engines[1].wait(timeout=30) is not None and host1.pid_files() == []
    finally:
        for engine in engines:
            if engine.poll() is None:
                engine.kill()


def test_the_hook_of_another_run_leaves_a_live_owners_engine_and_stops_it_once_its_owner_is_dead(tmp_path: Path):
    """A pid file names the process that started its engine: a second run's crash or cancel hook on the same
    run folder never stops the engine of a run that is still alive; once that run is killed, it does."""
    config = PipelineConfig(run_dir=tmp_path / "run")
    pid_file = RunLayout.of(config).pid_file("sampling")
    owner, pid = owned_engine(pid_file)
    engine = psutil.Process(pid)
    try:
        crash(config)
        assert engine.is_running() and pid_file.exists(), "a live run's engine was stopped by another run"
        owner.kill()
        owner.wait()
        crash(config)
        engine.wait(timeout=30)
        assert not pid_file.exists()
    finally:
        owner.kill()
        if engine.is_running():
            engine.kill()
