"""One run folder, one writer: every command that writes under `run_dir` holds an exclusive lock on
`<run_dir>/.writer.lock` (`fcntl.flock`, released by the kernel when its holder dies, however it dies), and
writes into it who holds it: host, pid, start time, command line, since when. A second writer is refused at
once, naming the holder. A host's slice of a run spread over hosts (`orchestration.host`) writes folders of
its own, so it has a lock of its own (`.writer-host-<i>-of-<N>.lock`): the slices of one run write side by
side, two writers of one slice never do.

The lock is the run's, not the process's: a process whose holder is itself or an ancestor (the flow inside
`eagle3 run`, a torchrun rank of the training task) writes under its holder's lock. A lock that made the run
folder leaves none behind when nothing else was written: a refused command leaves no run folder."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shlex
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from eagle3_core.hosts import HostSlice
from eagle3_core.identity import ProcessIdentity

LOCK_NAME = ".writer.lock"


class RunDirBusy(RuntimeError):
    """Another process writes this run folder; the message names it."""


def lock_path(run_dir: Path, part: HostSlice | None = None) -> Path:
    return run_dir / (LOCK_NAME if part is None else f".writer-{part.name}.lock")


def holder_record(command: list[str]) -> dict[str, object]:
    me = ProcessIdentity.current()
    return {"host": me.host, "pid": me.pid, "started": me.started, "command": command, "since": time.time()}


def read_holder(path: Path) -> dict[str, object]:
    """The holder a lock file names ({} when it names none readable: a holder still writing it)."""
    try:
        record = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def describe_holder(record: dict[str, object]) -> str:
    if not record:
        return "another process (it has not yet written its name)"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(record.get("since", 0))))  # type: ignore[arg-type]
    command = shlex.join(str(arg) for arg in record.get("command") or [])  # type: ignore[union-attr]
    return f"pid {record.get('pid')} on {record.get('host')} (`{command}`, since {since})"


def holder_is_ours(record: dict[str, object]) -> bool:
    """The holder is this process or one it descends from: the same run."""
    try:
        holder = ProcessIdentity(str(record["host"]), int(record["pid"]), float(record["started"]))  # type: ignore[arg-type]
    except (KeyError, TypeError, ValueError):
        return False
    return holder.is_self_or_ancestor()


def open_lock(path: Path) -> int | None:
    """An fd holding the exclusive lock of `path`, or None while another holds it. The file a holder
    removed while this one waited is not the lock any more: taken again on the file now there."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        try:
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)


def make_run_dir(run_dir: Path) -> list[Path]:
    """Create `run_dir`; returns the folders created, innermost first. A file or an unwritable folder is one
    clear error."""
    if run_dir.exists() and not run_dir.is_dir():
        raise NotADirectoryError(f"run_dir {run_dir} is a file, not a folder: set run_dir to a folder")
    created = [folder for folder in [run_dir, *run_dir.absolute().parents] if not folder.exists()]
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except PermissionError:
        raise PermissionError(f"run_dir {run_dir}: cannot create it (permission denied): set run_dir") from None
    if not os.access(run_dir, os.W_OK | os.X_OK):
        raise PermissionError(f"run_dir {run_dir} is not writable: set run_dir to a folder you can write")
    return created


@contextmanager
def run_dir_lock(
    run_dir: Path | str, part: HostSlice | None = None, command: list[str] | None = None
) -> Iterator[None]:
    """Hold the writer lock of `run_dir` (of `part`'s slice) for the block, or raise `RunDirBusy` naming the
    holder. Re-entered by its holder's own process or descendants, it holds nothing more."""
    run_dir = Path(run_dir)
    created = make_run_dir(run_dir)
    path = lock_path(run_dir, part)
    fd = open_lock(path)
    if fd is None:
        holder = read_holder(path)
        if holder_is_ours(holder):
            yield
            return
        raise RunDirBusy(
            f"run_dir {run_dir} is in use by {describe_holder(holder)}: wait until it ends, or give this "
            f"command another run_dir"
        )
    try:
        record = json.dumps(holder_record(command if command is not None else [sys.executable, *sys.argv]))
        os.ftruncate(fd, 0)
        os.pwrite(fd, record.encode(), 0)
        yield
    finally:
        if created and [p.name for p in run_dir.iterdir()] == [path.name]:  # nothing written: leave no folder
            path.unlink(missing_ok=True)
            with contextlib.suppress(OSError):  # a folder another process wrote into meanwhile stays
                for folder in created:
                    folder.rmdir()
        os.close(fd)
