"""Who holds a slot of a global concurrency limit, on disk, and whether that holder is still alive.

Prefect's lease of a slot names at most a flow run id, and with the ephemeral API (the default) the lease
lives in the memory of a temporary server that dies with its run: a run killed outright (SIGKILL, the OOM
killer, a lost host) leaves the slot taken, and nothing ever gives it back. So every holder also writes a
record here, one JSON file per lease (`<dir>/<lease id>.json`: limit, lease id, flow run id, host, pid,
the pid's start time, since), written under the book's lock together with the slot's acquisition and
removed after its release. A waiter reads the records under the same lock: a holder whose process is gone
on this host (its pid no longer runs, or runs a newer process) is dead, and its slot can be given back.

Pure bookkeeping: no Prefect import here (an import contract of pyproject.toml keeps it so). Taking and
releasing slots through the Prefect API is `tasks.gpu_slot.leases`."""

from __future__ import annotations

import fcntl
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from eagle3_core.files import write_text_atomic
from eagle3_core.identity import ProcessIdentity

__all__ = ["HolderBook", "HolderRecord", "ProcessIdentity", "waiting_text"]


@dataclass(frozen=True)
class HolderRecord:
    """One held slot: which lease, which flow run, which process, since when (epoch seconds)."""

    limit: str
    lease_id: str
    flow_run_id: str | None
    flow_run_name: str | None
    host: str
    pid: int
    started: float
    since: float

    @property
    def process(self) -> ProcessIdentity:
        return ProcessIdentity(self.host, self.pid, self.started)

    def describe(self) -> str:
        run = "a run"
        if self.flow_run_id:
            run = (
                f"flow run {self.flow_run_name} {self.flow_run_id}"
                if self.flow_run_name
                else f"flow run {self.flow_run_id}"
            )
        held = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        return f"{run} (pid {self.pid} on {self.host}), holding it since {held}"


class HolderBook:
    """The records of one limit's holders in `directory`, and the lock that makes "take the slot, write the
    record" and "read the records, give back a dead holder's slot" exclusive of each other (flock on
    `<directory>/.lock`: held by open file, so threads of one process exclude each other too)."""

    def __init__(self, directory: Path | str):
        self.directory = Path(directory)

    @contextmanager
    def locked(self) -> Iterator[None]:
        self.directory.mkdir(parents=True, exist_ok=True)
        with open(self.directory / ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def path(self, lease_id: str) -> Path:
        return self.directory / f"{lease_id}.json"

    def write(self, record: HolderRecord) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        write_text_atomic(self.path(record.lease_id), json.dumps(asdict(record)))

    def remove(self, lease_id: str) -> None:
        self.path(lease_id).unlink(missing_ok=True)

    def records(self) -> list[HolderRecord]:
        """Every record, oldest first; an unreadable one (a disk that filled mid-write) is dropped."""
        found = []
        for path in sorted(self.directory.glob("*.json")):
            try:
                found.append(HolderRecord(**json.loads(path.read_text())))
            except (OSError, ValueError, TypeError):
                path.unlink(missing_ok=True)
        return sorted(found, key=lambda r: r.since)


def waiting_text(live: list[HolderRecord], waited_s: float, lease_s: float) -> str:
    """What a waiter says while the slot is taken: the live holders on record, or, with none on record,
    that it waits for a holder of another host (whose lease the server revokes `lease_s` after its holder
    stopped renewing it)."""
    if live:
        held = "; ".join(r.describe() for r in live)
    else:
        held = (
            "a holder not recorded on this host (a run on another host: the server revokes its lease "
            f"{lease_s:.0f} s after it stops renewing it)"
        )
    return f"held by {held}; waited {waited_s:.0f} s so far"
