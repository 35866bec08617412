"""The launch of training under torchrun (`eagle3_core.training.launch`), piece by piece without starting it:
the process count, the commands, what a rank sends back (progress, events), and that the count is part of
no cache key (how a failed rank is told: `test_rank_failure.py`). `tests/integration/test_training_torchrun.py`
launches it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from eagle3_core.config import ConfigError, PipelineConfig, load_config
from eagle3_core.events import DECISION, RunEvents
from eagle3_core.progress import ProgressUpdate
from eagle3_core.serving.lifecycle import LogTail
from eagle3_core.training import launch
from eagle3_core.training.launch import (
    LAUNCH_ENV,
    PROGRESS_FILE,
    Rendezvous,
    launched_rank,
    relay,
    resolve_processes,
    torchrun_command,
    worker_command,
)
from eagle3_core.training.phase import phase_config
from tasks.training import POLICY as TRAINING_POLICY


@pytest.mark.parametrize(
    ("setting", "device", "visible", "processes"),
    [
        ("auto", "auto", 0, 1),  # a CPU host
        ("auto", "auto", 8, 8),  # every visible CUDA device
        ("auto", "cuda", 2, 2),
        ("auto", "cpu", 8, 1),  # training on the CPU of a GPU host
        ("auto", "cuda:1", 8, 1),  # one named GPU
        (2, "auto", 0, 2),  # gloo workers on a CPU
        (2, "cpu", 8, 2),
        (4, "auto", 8, 4),
        (1, "auto", 8, 1),
    ],
)
def test_the_process_count(setting, device: str, visible: int, processes: int) -> None:
    assert resolve_processes(setting, device, visible) == processes


def test_a_process_count_the_host_cannot_run_names_the_fields() -> None:
    with pytest.raises(ConfigError, match=r"training\.processes=9: 8 CUDA device\(s\) visible"):
        resolve_processes(9, "auto", 8)
    with pytest.raises(ConfigError, match=r"training\.device=cuda:1"):
        resolve_processes(2, "cuda:1", 8)


def test_the_field_takes_auto_or_a_positive_count() -> None:
    assert PipelineConfig().training.processes == "auto"
    assert load_config(None, ["training.processes=2"]).training.processes == 2
    for bad in ("0", "two"):
        with pytest.raises(ConfigError, match=r"training\.processes"):
            load_config(None, [f"training.processes={bad}"])


def test_the_processes_training_together_are_in_the_keys_as_the_global_batch(tmp_path: Path) -> None:
    """`training.batch_size` is per process: two processes train another schedule than one. One process keys
    as every run did before the count was keyed."""
    one = PipelineConfig(run_dir=tmp_path, training={"device": "cpu"})
    two = one.model_copy(deep=True)
    two.training.processes = 2
    assert phase_config(one, 2) != phase_config(one, 1) == phase_config(one)  # the core's checkpoint and resume key
    assert "world" not in phase_config(one)
    assert TRAINING_POLICY.key_content(one, {}) != TRAINING_POLICY.key_content(two, {})  # Prefect's
    assert TRAINING_POLICY.key_content(one, {})["extra"] is None, "one process: the key of runs before it"


def test_the_launch_is_torchrun_running_eagle3_train(tmp_path: Path) -> None:
    worker = worker_command(Path("/venv/bin/eagle3"), tmp_path / "c.yaml", tmp_path / "hs", tmp_path / "vocab")
    assert worker == [
        "/venv/bin/eagle3", "train", "-c", str(tmp_path / "c.yaml"),
        "--hidden-states", str(tmp_path / "hs"), "--vocab", str(tmp_path / "vocab"),
    ]  # fmt: skip
    command = torchrun_command(2, tmp_path / "logs", worker)
    assert command[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert command[-len(worker) :] == worker
    options = command[3 : -len(worker)]
    assert "--standalone" in options
    pairs = dict(zip(options[1::2], options[2::2], strict=True))
    assert pairs == {
        "--nnodes": "1",
        "--nproc-per-node": "2",
        "--max-restarts": "0",
        "--log-dir": str(tmp_path / "logs"),
        "--redirects": "3",
        "--tee": "3",
    }


def test_a_node_of_a_training_over_hosts_joins_the_c10d_rendezvous_on_the_first_host(tmp_path: Path) -> None:
    assert Rendezvous.of(PipelineConfig(run_dir=tmp_path)) is None
    overrides = ["orchestration.hosts=2", "orchestration.rendezvous_host=gpu-a", "orchestration.rendezvous_port=29511"]
    nodes = [load_config(overrides=[*overrides, f"orchestration.host={h}", f"run_dir={tmp_path}"]) for h in (0, 1)]
    rendezvous = [Rendezvous.of(config) for config in nodes]
    assert rendezvous[0].run_id == rendezvous[1].run_id  # one rendezvous for the run's nodes
    command = torchrun_command(4, tmp_path / "logs", ["eagle3", "train"], rendezvous[1])
    assert "--standalone" not in command
    options = command[3:-2]
    pairs = dict(zip(options[::2], options[1::2], strict=True))
    assert {
        k: pairs[k] for k in ("--nnodes", "--node-rank", "--rdzv-backend", "--rdzv-endpoint", "--nproc-per-node")
    } == {
        "--nnodes": "2",
        "--node-rank": "1",
        "--rdzv-backend": "c10d",
        "--rdzv-endpoint": "gpu-a:29511",
        "--nproc-per-node": "4",
    }
    assert pairs["--rdzv-id"] == rendezvous[1].run_id
    other_run = Rendezvous.of(nodes[0].model_copy(update={"run_dir": tmp_path / "other"}))
    assert other_run.run_id != rendezvous[0].run_id


def test_a_rank_outside_a_launch_keeps_its_own_progress(monkeypatch) -> None:
    monkeypatch.delenv(LAUNCH_ENV, raising=False)
    assert launched_rank() is None


def test_rank_0_sends_its_progress_and_the_others_none(tmp_path: Path, monkeypatch) -> None:
    armed = []
    monkeypatch.setattr(launch, "die_with_launcher", armed.append)  # not on the test process itself
    monkeypatch.setenv(LAUNCH_ENV, str(tmp_path))
    update = ProgressUpdate(phase="training", stage="steps", done=3, total=8, unit="steps", message="loss 4.2")
    monkeypatch.setenv("RANK", "1")
    with launched_rank() as progress:
        progress(update)
    assert not (tmp_path / PROGRESS_FILE).exists()
    monkeypatch.setenv("RANK", "0")
    with launched_rank() as progress:
        progress(update)
        progress(update.model_copy(update={"done": 4}))
    assert len(armed) == 2, "every rank of a launch dies with its agent"

    events = RunEvents(tmp_path)
    events.record("training", DECISION, "resuming at step 2")
    got, lines = [], []
    relay(LogTail(tmp_path / PROGRESS_FILE), LogTail(events.path), got.append, lines.append)
    assert got == [update, update.model_copy(update={"done": 4})]
    assert lines == ["[training] resuming at step 2"]
