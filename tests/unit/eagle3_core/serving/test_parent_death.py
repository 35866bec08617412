"""Children that die with their parent (`eagle3_core.serving.parent_death`): a parent-death signal set by
the parent at the child's start, or armed by the child itself (as a torchrun rank does); real processes,
real SIGKILLs."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import psutil

from eagle3_core.serving.parent_death import die_with_parent

REPO = Path(__file__).resolve().parents[4]


def assert_child_dies_with_its_parent(parent_script: str) -> None:
    """Run `parent_script` (it prints its child's pid once the child is set up), SIGKILL it, and wait for the
    child to end: TimeoutExpired if the child outlives its parent."""
    parent = subprocess.Popen(
        [sys.executable, "-c", parent_script],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        text=True,
    )
    child = psutil.Process(int(parent.stdout.readline()))
    parent.kill()
    parent.wait()
    child.wait(timeout=10)


def test_a_child_with_a_parent_death_signal_dies_with_its_parent(tmp_path: Path):
    assert_child_dies_with_its_parent(
        "import signal, subprocess, sys, time\n"
        "from eagle3_core.serving.parent_death import die_with_parent\n"
        "child = subprocess.Popen(['sleep', '600'], preexec_fn=die_with_parent(signal.SIGTERM))\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    assert die_with_parent() is not None, "armed in the main thread"
    found: list[object] = []
    worker = threading.Thread(target=lambda: found.append(die_with_parent()))
    worker.start()
    worker.join()
    assert found == [None], "never armed from a helper thread (the signal follows the thread)"


def test_a_child_that_arms_the_signal_itself_dies_with_its_parent():
    """As a torchrun rank does against its agent (`die_with_launcher`): the parent starts it plainly."""
    arm = "from eagle3_core.serving.parent_death import die_with_launcher; import time; die_with_launcher(); "
    assert_child_dies_with_its_parent(
        "import subprocess, sys, time\n"
        f"child = subprocess.Popen([sys.executable, '-c', {arm + 'print(1, flush=True); time.sleep(600)'!r}],"
        " stdout=subprocess.PIPE, text=True)\n"
        "child.stdout.readline()\n"  # armed
        "print(child.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
