"""The kill-engine fault (EAGLE3_FAULT `<phase>:kill-engine@<unit>=<n>`) on real processes: a stand-in
engine (a process whose command line names vLLM's server module, with a worker in its own process group,
as VllmServer starts it) gets a real SIGKILL of its whole group at the configured progress point, once per
process or, with `kill-engine-always`, in every attempt; other children are never touched."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from eagle3_core.faults import ENGINE_MODULE, ENV, faulting_progress, parse_engine_kill
from eagle3_core.progress import ProgressUpdate
from eagle3_core.serving.processes import alive

ENGINE = "import subprocess, sys, time\nsubprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
ENGINE += "time.sleep(120)"


def start(module_in_command: bool) -> subprocess.Popen:
    """A process with one worker, in its own session (group); named like a vLLM server if asked."""
    command = [sys.executable, "-c", ENGINE] + ([ENGINE_MODULE] if module_in_command else [])
    process = subprocess.Popen(command, start_new_session=True)
    deadline = time.monotonic() + 30
    while not psutil.Process(process.pid).children() and time.monotonic() < deadline:
        time.sleep(0.05)
    return process


def requests(done: int) -> ProgressUpdate:
    return ProgressUpdate(phase="sampling", stage="requests", done=done, total=100, unit="requests")


@pytest.fixture
def processes():
    """Processes a test started; their groups are killed afterwards, whatever the test did."""
    started: list[subprocess.Popen] = []
    yield started
    for process in started:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def test_kill_points_are_parsed():
    kill = parse_engine_kill("sampling", "kill-engine@requests=8")
    assert (kill.entry, kill.unit, kill.count, kill.always) == ("sampling:kill-engine@requests=8", "requests", 8, False)
    assert parse_engine_kill("extraction", "kill-engine-always@samples=4").always
    assert parse_engine_kill("extraction", "kill-engine-core@samples=4").core_only
    assert parse_engine_kill("extraction", "kill-process@samples=4").whole_process
    assert not parse_engine_kill("extraction", "kill-engine@samples=4").whole_process
    assert parse_engine_kill("sampling", "requests=8") is None
    assert parse_engine_kill("sampling", "kill-engine@requests") is None


def test_kill_engine_sigkills_the_engine_group_once_and_spares_other_children(processes, monkeypatch):
    monkeypatch.setenv(ENV, "once-phase:kill-engine@requests=3")
    engine, bystander = start(module_in_command=True), start(module_in_command=False)
    processes += [engine, bystander]
    worker = psutil.Process(engine.pid).children()[0]
    report = faulting_progress("once-phase", lambda update: None)
    report(requests(2))
    assert engine.poll() is None
    report(requests(3))
    assert engine.wait(timeout=10) == -9
    assert psutil.wait_procs([worker], timeout=10)[1] == [], "the engine's worker dies with it"
    assert bystander.poll() is None

    restarted = start(module_in_command=True)
    processes.append(restarted)
    faulting_progress("once-phase", lambda update: None)(requests(50))  # the retry's own progress callback
    assert restarted.poll() is None, "kill-engine fires once per process"


def test_kill_engine_always_fires_in_every_attempt(processes, monkeypatch):
    monkeypatch.setenv(ENV, "always-phase:kill-engine-always@requests=1")
    for _ in range(2):
        engine = start(module_in_command=True)
        processes.append(engine)
        report = faulting_progress("always-phase", lambda update: None)
        report(requests(1))
        assert engine.wait(timeout=10) == -9


def test_kill_engine_core_sigkills_only_the_servers_children(processes, monkeypatch):
    monkeypatch.setenv(ENV, "core-phase:kill-engine-core@requests=1")
    engine = start(module_in_command=True)
    processes.append(engine)
    worker = psutil.Process(engine.pid).children()[0]
    faulting_progress("core-phase", lambda update: None)(requests(1))
    deadline = time.monotonic() + 10
    while alive(worker) and time.monotonic() < deadline:  # a zombie: the stand-in never reaps it
        time.sleep(0.05)
    assert not alive(worker)
    assert engine.poll() is None, "the API server is left to notice its dead engine by itself"
