"""The processes of a started server: find the whole tree (workers included, even orphaned ones), stop
it (SIGTERM to the process group, SIGKILL after a grace period, verify none survives) and, on CUDA GPUs,
wait until its memory is released so the next phase's engine can load. `stop_server(pid_file)` is what
crash and cancel hooks call. A pid file names the host its process runs on: hosts share the run directory,
and a pid means nothing on another host (nor in another container's pid namespace), so a pid file of
another host is left alone. It names its owner too, the process that started the server (pid and start
time, so a reused pid is not taken for it): only a dead owner's server, or this process's own, is stopped;
a live run's engine is never stopped by another process."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from eagle3_core.config import env_reference
from eagle3_core.files import write_text_atomic
from eagle3_core.gpus import gpu_compute_apps
from eagle3_core.identity import ProcessIdentity

POLL_S = 0.5


class ServerError(RuntimeError):
    """The server could not be started or stopped; the message carries the log's last lines."""


def expand_references(variables: dict[str, str], environ: dict[str, str] | None = None) -> dict[str, str]:
    """`variables` with every `$VAR` value replaced by this process's variable (`environ`, default
    `os.environ`), at the last moment: a secret passed so is in the engine's environment only, never in
    a file. A variable that is not set is a `ServerError` naming it."""
    environ = dict(os.environ) if environ is None else environ
    missing = [
        f"{name}=${ref}" for name, value in variables.items() if (ref := env_reference(value)) and ref not in environ
    ]
    if missing:
        raise ServerError(f"{', '.join(missing)}: not set in this process's environment; export it, then run again")
    return {name: environ[ref] if (ref := env_reference(value)) else value for name, value in variables.items()}


def wait_gpu_release(
    pids: set[int],
    timeout_s: float,
    query: Callable[[], dict[int, int] | None] = gpu_compute_apps,
) -> None:
    """Wait until none of `pids` holds GPU memory any more; the timeout names those that still do."""
    deadline = time.monotonic() + timeout_s
    while True:
        apps = query()
        holding = {pid: mib for pid, mib in (apps or {}).items() if pid in pids}
        if not holding:
            return
        if time.monotonic() >= deadline:
            held = ", ".join(f"pid {pid} ({mib} MiB)" for pid, mib in sorted(holding.items()))
            raise ServerError(f"GPU memory not released {timeout_s:.0f} s after the server stopped: {held}")
        time.sleep(POLL_S)


def alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def server_processes(pid: int, pgid: int, started: float) -> list[psutil.Process]:
    """The server's process tree: the root, its descendants, and anything left in its process group
    (workers whose parent already died are re-parented but keep the group). A root created after `started`,
    or a group member created before it, is a pid-reuse impostor and excluded."""
    found: dict[int, psutil.Process] = {}
    try:
        root = psutil.Process(pid)
        if root.create_time() <= started + 1:
            found[pid] = root
            found.update({c.pid: c for c in root.children(recursive=True)})
    except psutil.NoSuchProcess:
        pass
    for proc in psutil.process_iter(["pid", "create_time"]):
        try:
            if os.getpgid(proc.pid) == pgid and proc.info["create_time"] >= started - 1:
                found.setdefault(proc.pid, proc)
        except (ProcessLookupError, psutil.Error):
            continue
    return [p for p in found.values() if alive(p)]


def kill_tree(pid: int, pgid: int, started: float, grace_s: float) -> tuple[set[int], bool]:
    """SIGTERM the whole group, SIGKILL whatever is left after `grace_s`; raise if anything survives.
    Returns (every pid of the tree, whether SIGKILL was needed)."""
    procs = server_processes(pid, pgid, started)
    pids = {p.pid for p in procs}
    signal_group(pgid, signal.SIGTERM, procs)
    _, remaining = psutil.wait_procs(procs, timeout=grace_s)
    remaining = [p for p in remaining if alive(p)]
    if remaining:
        signal_group(pgid, signal.SIGKILL, remaining)
        psutil.wait_procs(remaining, timeout=10)
    survivors = [p.pid for p in server_processes(pid, pgid, started)]
    if survivors:
        raise ServerError(f"server processes still alive after SIGKILL: {survivors}")
    return pids, bool(remaining)


def signal_group(pgid: int, sig: signal.Signals, procs: list[psutil.Process]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)
    for proc in procs:
        try:
            proc.send_signal(sig)
        except psutil.NoSuchProcess:
            continue


def write_pid_file(pid_file: Path, pid: int, **details: object) -> float:
    """Record a process started in a session of its own (its pid is its group's): pid, start time, this
    host's name, its owner (this process) and `details`. Returns the start time (what `kill_tree` tells
    impostors by)."""
    started = psutil.Process(pid).create_time()
    owner = vars(ProcessIdentity.current())
    record = {"pid": pid, "pgid": pid, "started": started, "host": socket.gethostname(), "owner": owner, **details}
    write_text_atomic(pid_file, json.dumps(record))
    return started


def live_owner(info: dict) -> ProcessIdentity | None:
    """The owner of a pid file's server while it runs and is not this process: that server is its to stop.
    None when the owner is gone, is this process, or is not named (a pid file of an older version)."""
    try:
        owner = ProcessIdentity(**info["owner"])
    except (KeyError, TypeError):
        return None
    if owner.alive() is False or (owner.host == socket.gethostname() and owner.pid == os.getpid()):
        return None
    return owner


def read_pid_file(pid_file: Path) -> dict | None:
    """A pid file's record; None when it is gone, or torn (a writer killed mid-write never started its server)."""
    try:
        info = json.loads(pid_file.read_text())
    except FileNotFoundError:
        return None
    except ValueError:
        pid_file.unlink(missing_ok=True)
        return None
    return info if isinstance(info, dict) else None


def stop_server(pid_file: Path, grace_s: float = 30, gpu_release_timeout_s: float = 120) -> set[int]:
    """Stop the server a pid file names (crash and cancel hooks use this) and remove the file.
    Returns the pids that were stopped (empty when it was already gone, runs on another host, or belongs to
    another live process: those files are left to their host and owner)."""
    info = read_pid_file(Path(pid_file))
    if info is None or info.get("host", socket.gethostname()) != socket.gethostname() or live_owner(info):
        return set()
    pids, _ = kill_tree(info["pid"], info["pgid"], info["started"], grace_s)
    if pids:
        wait_gpu_release(pids, gpu_release_timeout_s)
    Path(pid_file).unlink(missing_ok=True)
    return pids
