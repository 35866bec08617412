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
from flows.hooks import stop_engines

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
