"""`eagle3 plan` and `eagle3 run --dry-run`: the plan printed, on this host or an assumed one, with no run
folder written, no engine or Prefect server started, no weight loaded; exit 1 when the plan does not fit."""

from __future__ import annotations

from pathlib import Path

import psutil
from typer.testing import CliRunner

from cli.main import app
from tests.helpers.devices import kimi_folder
from tests.helpers.targets import KIMI_TEXT

REPO = Path(__file__).parents[3]


def children() -> set[int]:
    return {child.pid for child in psutil.Process().children(recursive=True)}


def test_run_dry_run_prints_the_plan_and_writes_and_starts_nothing(tmp_path, smollm2_target):
    run_dir = tmp_path / "run"
    before = children()
    result = CliRunner().invoke(
        app, ["run", "--dry-run", "-c", str(REPO / "configs/demo.yaml"), "--set", f"run_dir={run_dir}"]
    )
    assert result.exit_code == 0, result.output
    assert result.output.startswith(f"# Plan of {run_dir}\n")
    assert "## sampling: runs" in result.output and "## evaluation: runs" in result.output
    assert not run_dir.exists(), "a dry run writes no run folder (no events.jsonl, no pid file)"
    assert children() <= before, "a dry run starts no engine and no Prefect server"


def test_plan_for_an_assumed_host_and_its_exit_status(tmp_path):
    folder = kimi_folder(tmp_path / "Kimi-K2.5", KIMI_TEXT)
    args = ["plan", "-c", str(REPO / "configs/kimi-k2.5-8gpu.yaml"), "--set", f"target.model={folder}"]
    args += ["--set", f"run_dir={tmp_path / 'run'}", "--gpus", "8", "--gpu-name", "NVIDIA H200"]
    fits = CliRunner().invoke(app, [*args, "--gpu-memory-gib", "140.4"])
    assert fits.exit_code == 0, fits.output
    assert "- host: 8 x NVIDIA H200 (140.4 GiB each)" in fits.output
    too_small = CliRunner().invoke(app, [*args, "--gpu-memory-gib", "79.6"])
    assert too_small.exit_code == 1
    assert "- **problem**: server: 69.2 GiB of weights a rank leave 0.0 GiB" in too_small.output
    assert not (tmp_path / "run").exists()
