"""The suite's one demo run (tests/helpers/demo_run.py) is built once whatever the number of xdist workers that
ask for it at the same moment, every worker reads the same record of it, and a failed build fails each reader
with the demo's own output. `make demo` is stood in by a function that writes the run folder, counted."""

from __future__ import annotations

import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.helpers import demo_run


class WorkerTemp:
    """A worker's TempPathFactory as far as the demo run uses it: its base temp, one folder per worker."""

    def __init__(self, base: Path):
        self.base = base

    def getbasetemp(self) -> Path:
        self.base.mkdir(parents=True, exist_ok=True)
        return self.base


def fake_make(returncode: int, calls: list[Path]):
    lock = threading.Lock()

    def run_make(command: str, config: Path) -> subprocess.CompletedProcess[str]:
        assert command == demo_run.DEMO_COMMAND
        with lock:
            calls.append(config)
        time.sleep(0.3)  # long enough for the other worker to ask meanwhile
        (config.parent / "demo" / "draft").mkdir(parents=True)
        return subprocess.CompletedProcess(command.split(), returncode, "demo printed this", "")

    return run_make


def test_two_workers_asking_at_once_build_one_demo_and_read_the_same(tmp_path: Path, monkeypatch) -> None:
    calls: list[Path] = []
    monkeypatch.setattr(demo_run, "run_make", fake_make(0, calls))
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    workers = [WorkerTemp(tmp_path / "session" / f"popen-gw{i}") for i in range(2)]

    with ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(demo_run.suite_demo_run, workers))

    assert len(calls) == 1, "built once for both workers"
    assert runs[0] == runs[1]
    assert runs[0].run_dir == tmp_path / "session" / "demo-run" / "demo" and runs[0].run_dir.is_dir()
    assert runs[0].returncode == 0 and runs[0].stdout == "demo printed this"
    assert demo_run.suite_demo_run(workers[0]) == runs[0] and len(calls) == 1, "a later test reads the record"


def test_a_failed_demo_fails_each_reader_with_its_output(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(demo_run, "run_make", fake_make(2, []))
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)

    run = demo_run.suite_demo_run(WorkerTemp(tmp_path / "session"))

    assert run.run_dir == tmp_path / "session" / "demo-run" / "demo"
    with pytest.raises(pytest.fail.Exception, match="exited 2:\ndemo printed this"):
        run.sample_set()
