"""VllmServer's lifecycle against a fake engine: a small Python server that prints recorded vLLM log lines,
spawns a worker child, and answers /health. Checks progress events, the load seconds, a stall, a crash,
the process-tree stop, SIGKILL after the grace period, stale servers and an occupied port."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from eagle3_core.config import ServerConfig
from eagle3_core.events import DECISION, ENGINE_START, ENGINE_STOP, WEIGHT_LOAD, RunEvents
from eagle3_core.hosts import HostSlice
from eagle3_core.progress import ProgressUpdate
from eagle3_core.serving import engine as serving
from eagle3_core.serving import lifecycle
from eagle3_core.serving import processes as server_processes
from tests.helpers.openai_standin import OpenAIStandIn
from tests.helpers.openai_standin import serving as serving_standin
from tests.helpers.processes import owned_engine

FAKE_SERVER = textwrap.dedent(
    """
    import http.server, os, signal, subprocess, sys, time
    port = int(sys.argv[sys.argv.index("--port") + 1])
    mode = os.environ["FAKE_MODE"]
    worker = [sys.executable, "-c", "import time\\nwhile True: time.sleep(1)"]
    if os.environ.get("FAKE_IGNORE_TERM"):
        worker = [sys.executable, "-c",
                  "import signal, time\\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\\nwhile True: time.sleep(1)"]
    child = subprocess.Popen(worker)
    open(os.environ["FAKE_CHILD_PID"], "w").write(str(child.pid))
    for line in open(os.environ["FAKE_LOG"]).read().split("\\n"):
        sys.stderr.write(line.replace("<CR>", "\\r") + ("" if line.endswith("<CR>") else "\\n"))
        sys.stderr.flush()
        time.sleep(0.01)
    if mode == "crash":
        sys.stderr.write("RuntimeError: CUDA out of memory\\n")
        sys.exit(3)
    if mode == "stall":
        while True:
            time.sleep(1)
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
        def log_message(self, *args):
            pass
    http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
    """
)

WORKER = "(Worker_TP0 pid=340648) "
SHARD_LINES = [
    "(Worker_TP0 pid=340648) INFO 02-22 12:26:38 [weight_utils.py:1108] Filesystem type for checkpoints: EXT4.",
    "Loading safetensors checkpoint shards:   0% Completed | 0/64 [00:00<?, ?it/s]<CR>",
    WORKER + "Loading safetensors checkpoint shards:   2% Completed | 1/64 [00:00<00:35,  1.79it/s]<CR>",
    WORKER + "Loading safetensors checkpoint shards:   6% Completed | 4/64 [01:33<27:17, 27.30s/it]<CR>",
    WORKER + "Loading safetensors checkpoint shards:  88% Completed | 56/64 [21:20<03:30, 26.20s/it]<CR>",
    WORKER + "Loading safetensors checkpoint shards: 100% Completed | 64/64 [24:27<00:00, 22.93s/it]",
    "(Worker_TP0 pid=340648) INFO 02-22 12:51:05 [default_loader.py:293] Loading weights took 1467.29 seconds",
]


@pytest.fixture
def fake_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Returns a function that configures the fake engine and gives the ServerConfig to start it with."""
    script = tmp_path / "fake_vllm.py"
    script.write_text(FAKE_SERVER)

    def fake_command(config, model_dir, port, extra):
        return [sys.executable, str(script), "--port", str(port)]

    monkeypatch.setattr(serving, "build_command", fake_command)

    def configure(mode: str = "serve", lines: list[str] = SHARD_LINES, ignore_term: bool = False, **fields):
        log = tmp_path / "recorded.log"
        log.write_text("\n".join(lines))
        env = {"FAKE_MODE": mode, "FAKE_LOG": str(log), "FAKE_CHILD_PID": str(tmp_path / "child.pid")}
        if ignore_term:
            env["FAKE_IGNORE_TERM"] = "1"
        return ServerConfig(env=env, **{"startup_timeout_s": 30, "stop_grace_s": 5, **fields})

    return configure


def child_pid(tmp_path: Path) -> int:
    return int((tmp_path / "child.pid").read_text())


def gone(pid: int) -> bool:
    return not psutil.pid_exists(pid) or not server_processes.alive(psutil.Process(pid))


def test_start_reports_progress_records_events_and_stop_leaves_nothing(tmp_path, fake_engine):
    updates: list[ProgressUpdate] = []
    events = RunEvents(tmp_path / "run")
    server = serving.VllmServer(fake_engine(), "model", tmp_path / "run", events, updates.append)
    with server:
        assert server.healthy()
        info = json.loads(server.pid_file.read_text())
        root = psutil.Process(info["pid"])
        child = psutil.Process(child_pid(tmp_path))
        assert child.ppid() == root.pid
    assert not server.pid_file.exists()
    assert gone(root.pid) and gone(child.pid)
    shards = [(u.done, u.total, u.eta_s) for u in updates if u.stage == "weight load"]
    assert shards == [(0, 64, None), (1, 64, 35), (4, 64, 27 * 60 + 17), (56, 64, 210), (64, 64, 0)]
    assert "weight load: 56/64 shards · ETA 210 s" in [u.line() for u in updates]
    load = [e for e in events.read() if e["event"] == WEIGHT_LOAD]
    assert len(load) == 1 and load[0]["seconds"] == pytest.approx(1467.29) and load[0]["source"] == "log"
    assert [e["event"] for e in events.read()] == [ENGINE_START, WEIGHT_LOAD, ENGINE_STOP]


def test_weight_load_seconds_are_measured_when_the_log_has_none(tmp_path, fake_engine):
    events = RunEvents(tmp_path)
    with serving.VllmServer(fake_engine(lines=SHARD_LINES[:2]), "model", tmp_path, events):
        pass
    (load,) = [e for e in events.read() if e["event"] == WEIGHT_LOAD]
    assert load["source"] == "measured" and 0 < load["seconds"] < 30


def test_stall_fails_fast_with_last_log_lines_and_kills_the_server(tmp_path, fake_engine):
    server = serving.VllmServer(fake_engine("stall", stall_timeout_s=2), "model", tmp_path, RunEvents(tmp_path))
    begun = time.monotonic()
    with pytest.raises(serving.ServerError, match="stalled") as info:
        server.start()
    assert time.monotonic() - begun < 15
    assert "Loading weights took 1467.29 seconds" in str(info.value)
    assert gone(child_pid(tmp_path))
    assert not server.pid_file.exists()


def test_crash_during_start_reports_exit_code_and_log(tmp_path, fake_engine):
    server = serving.VllmServer(fake_engine("crash"), "model", tmp_path, RunEvents(tmp_path))
    with pytest.raises(serving.ServerError, match="exited with code 3") as info:
        server.start()
    assert "CUDA out of memory" in str(info.value)
    assert gone(child_pid(tmp_path))


def test_exit_report_is_none_while_running_then_names_the_signal_and_the_log_errors(tmp_path, fake_engine):
    noise = [f' - leaked function "get_int{i}_ty"' for i in range(40)]  # vLLM's exit prints pages of this
    lines = [*SHARD_LINES, "ERROR 11-30 [async_llm.py:906] EngineDeadError: EngineCore encountered an issue", *noise]
    events = RunEvents(tmp_path)
    with serving.VllmServer(fake_engine(lines=lines), "model", tmp_path, events) as server:
        assert server.exit_report(wait_s=0.2) is None
        os.killpg(server.process.pid, signal.SIGKILL)
        report = server.exit_report(wait_s=10)
    assert "died: killed by SIGKILL" in report
    errors, tail = report.split("last lines:")
    assert "EngineDeadError" in errors and "Loading weights" not in errors
    assert noise[-1] in tail and noise[0] not in tail
    assert gone(child_pid(tmp_path)) and not server.pid_file.exists()
    with serving.VllmServer(fake_engine(lines=SHARD_LINES), "model", tmp_path, events) as restarted:
        assert "EngineDeadError" in restarted.previous_log_path.read_text(), "the dead engine's log is kept"
        assert "EngineDeadError" not in restarted.log_path.read_text()


def test_worker_ignoring_sigterm_is_killed_after_grace(tmp_path, fake_engine):
    events = RunEvents(tmp_path)
    server = serving.VllmServer(fake_engine(ignore_term=True, stop_grace_s=1), "model", tmp_path, events)
    server.start()
    worker = psutil.Process(child_pid(tmp_path))
    server.stop()
    assert not server_processes.alive(worker)
    (stop,) = [e for e in events.read() if e["event"] == ENGINE_STOP]
    assert stop["sigkill"] is True and worker.pid in stop["processes"]


def test_stale_server_from_crashed_run_is_stopped_at_next_start(tmp_path, fake_engine):
    events = RunEvents(tmp_path)
    config = fake_engine()
    crashed = serving.VllmServer(config, "model", tmp_path, events)
    crashed.start()
    stale_root = psutil.Process(crashed.process.pid)
    stale_worker = psutil.Process(child_pid(tmp_path))
    crashed.process = None  # the owning run died without stopping it
    with serving.VllmServer(config, "model", tmp_path, events, phase="extraction") as fresh:
        assert fresh.healthy()
        assert gone(stale_worker.pid) and gone(stale_root.pid)
    assert [e.get("stale") for e in events.read() if e["event"] == ENGINE_STOP] == [True, None]
    assert list((tmp_path / "server").glob("*.pid")) == []


def test_an_engine_start_leaves_a_live_runs_engine_of_the_same_run_folder_running(tmp_path, fake_engine):
    """A pid file names its owner: the stale-engine cleanup before a start stops only a dead owner's engine,
    and says in a decision line which one it left running."""
    events = RunEvents(tmp_path)
    owner, pid = owned_engine(tmp_path / "server" / "sampling.pid")
    try:
        with serving.VllmServer(fake_engine(), "model", tmp_path, events, phase="extraction") as fresh:
            assert fresh.healthy() and psutil.Process(pid).is_running()
        [left] = [e["message"] for e in events.read() if e["event"] == DECISION]
        host = socket.gethostname()
        assert left == f"left the server of sampling.pid running: its owner, pid {owner.pid} on {host}, is alive"
    finally:
        owner.kill()
        owner.wait()
        serving.stop_server(tmp_path / "server" / "sampling.pid", grace_s=5)


def test_occupied_port_is_a_clear_error(tmp_path, fake_engine):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        server = serving.VllmServer(fake_engine(port=port), "model", tmp_path, RunEvents(tmp_path))
        with pytest.raises(serving.PortInUseError, match=f"port {port} on 127.0.0.1 is already in use"):
            server.start()
    assert server.process is None and not (tmp_path / "server" / "engine.pid").exists()


def test_stop_server_hook_stops_by_pid_file(tmp_path, fake_engine):
    server = serving.VllmServer(fake_engine(), "model", tmp_path, RunEvents(tmp_path))
    server.start()
    worker = psutil.Process(child_pid(tmp_path))
    stopped = serving.stop_server(server.pid_file, grace_s=5)
    assert worker.pid in stopped and server.process.pid in stopped
    assert not server_processes.alive(worker) and not server.pid_file.exists()
    assert serving.stop_server(server.pid_file) == set()


def test_external_server_starts_and_stops_nothing(monkeypatch):
    monkeypatch.setattr(lifecycle.subprocess, "Popen", None)
    with serving_standin(OpenAIStandIn) as url:
        server = serving.ExternalServer(f"{url}/v1/", "key")
        with server as same:
            assert same.base_url == url and same.api_key == "key"


def test_an_external_server_that_does_not_answer_is_a_clear_error_at_its_start():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        with pytest.raises(serving.ServerError, match=f"^the external server at {url} does not answer .*server.url$"):
            serving.ExternalServer(f"{url}/v1").start()


def test_each_hosts_slice_has_its_own_engine_files_and_its_restart_stops_only_its_own(tmp_path, fake_engine):
    """Two hosts' slices sampling into one run directory: each engine has its own pid file and log, and the
    stale-engine cleanup at the start of host 0's next engine stops host 0's leftover, not host 1's engine."""
    events = RunEvents(tmp_path)
    config = fake_engine()
    host0, host1 = (
        serving.VllmServer(config, "model", tmp_path, events, phase="sampling", part=HostSlice(i, 2)) for i in (0, 1)
    )
    host0.start()
    try:
        host1.start()
        assert {host0.pid_file.name, host1.pid_file.name} == {"sampling-host-0-of-2.pid", "sampling-host-1-of-2.pid"}
        assert host0.log_path != host1.log_path and host0.log_path.exists() and host1.log_path.exists()
        assert json.loads(host1.pid_file.read_text())["pid"] == host1.process.pid
        stale = psutil.Process(host0.process.pid)
        host0.process = None  # host 0's run died without stopping it
        with serving.VllmServer(config, "model", tmp_path, events, phase="extraction", part=HostSlice(0, 2)):
            assert gone(stale.pid)
            assert host1.process.poll() is None and host1.healthy() and host1.pid_file.exists()
        assert [p.name for p in (tmp_path / "server").glob("*.pid")] == [host1.pid_file.name]
    finally:
        host1.stop()
        host0.stop()
        serving.stop_server(host0.pid_file, grace_s=5)  # a leftover the test did not get to stop
