"""Processes for the tests of the GPU slot and of the temporary Prefect server: a pid that no longer runs,
and the `decision` lines a run wrote."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from eagle3_core.events import DECISION, RunEvents


def decisions(run_dir: Path) -> list[dict]:
    return [e for e in RunEvents(run_dir).read() if e["event"] == DECISION]


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid
