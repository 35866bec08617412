"""Processes for the tests: a pid that no longer runs and the `decision` lines a run wrote (the GPU slot's
and the temporary Prefect server's tests), an engine owned by another live process (`owned_engine`), and
Prefect process workers of pool `gpu` started and stopped for
the tests that run flows through them.

A worker's first SIGTERM or SIGINT (`setup_signal_handlers_worker` forwards SIGTERM to SIGINT) cancels its
loops and runs its teardown: the worker-stopped event over the events websocket (up to 10 reconnections,
each waiting on the server), the close of its and its Runner's cancellation subscriptions, its client. Each
step is a round trip to the server, bounded only by its own timeouts: against a loaded server in CI a
worker was still at it after 2 minutes (its events client logging failed deliveries), against a stopped
one 30 s here. Nothing of that is what the tests check, so `stop_workers` stops them all at once, waits one
short grace for that teardown, and then kills what is left with its flow-run processes."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from eagle3_core.events import DECISION, RunEvents

PREFECT = str(Path(sys.executable).parent / "prefect")
REPO = Path(__file__).resolve().parents[2]


OWNER = (
    "import subprocess, sys, time; from pathlib import Path; from eagle3_core.serving.processes import write_pid_file\n"
    "engine = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'], start_new_session=True)\n"
    "write_pid_file(Path(sys.argv[1]), engine.pid); print(engine.pid, flush=True); time.sleep(300)\n"
)


def owned_engine(pid_file: Path) -> tuple[subprocess.Popen, int]:
    """Another live process (the owner) that started an engine stand-in recorded in `pid_file`, as a run's
    phase does: (the owner, the engine's pid). Kill the owner to make it a dead run's leftover."""
    pid_file.parent.mkdir(parents=True, exist_ok=True)
    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(pid_file)], stdout=subprocess.PIPE, text=True)
    assert owner.stdout is not None
    return owner, int(owner.stdout.readline())


def decisions(run_dir: Path) -> list[dict]:
    return [e for e in RunEvents(run_dir).read() if e["event"] == DECISION]


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def start_worker(env: dict[str, str], *options: str) -> subprocess.Popen:
    """`prefect worker start --pool gpu` from the repository (the deployments' flows run there), in a session
    of its own so that `stop_workers` can kill it with the flow-run processes it started."""
    command = [PREFECT, "worker", "start", "--pool", "gpu", *options]
    return subprocess.Popen(command, cwd=REPO, env=env, start_new_session=True)


def stop_workers(workers: Sequence[subprocess.Popen], grace_s: float = 10) -> None:
    """SIGINT to every worker at once (what Ctrl-C sends: cancel the loops, tear down), one deadline `grace_s`
    away for all of them, then SIGKILL to the process group of each one still running."""
    for worker in workers:
        if worker.poll() is None:
            worker.send_signal(signal.SIGINT)
    deadline = time.monotonic() + grace_s
    for worker in workers:
        with contextlib.suppress(subprocess.TimeoutExpired):
            worker.wait(timeout=max(deadline - time.monotonic(), 0))
    for worker in workers:
        with contextlib.suppress(ProcessLookupError):  # its group: the worker and the flow runs it started
            os.killpg(worker.pid, signal.SIGKILL)
        worker.wait()
