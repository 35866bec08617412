"""A process told apart from a later one that got its pid: host, pid and start time. The GPU slot's holder
records, the run folder's lock and the engines' pid files name their owner so; a pid alone is reused."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import psutil

# Start times of one process read twice agree to the clock tick; a reused pid starts later than that.
START_TIME_TOLERANCE_S = 0.05


@dataclass(frozen=True)
class ProcessIdentity:
    """A process, told apart from a later one that got the same pid by its start time."""

    host: str
    pid: int
    started: float

    @classmethod
    def current(cls) -> ProcessIdentity:
        return cls.of(os.getpid())

    @classmethod
    def of(cls, pid: int) -> ProcessIdentity:
        return cls(socket.gethostname(), pid, psutil.Process(pid).create_time())

    def alive(self) -> bool | None:
        """True while the process runs, False once it is gone (exited, killed, or its pid reused by a
        newer process), None when that cannot be told from here (another host)."""
        if self.host != socket.gethostname():
            return None
        try:
            process = psutil.Process(self.pid)
            if process.status() == psutil.STATUS_ZOMBIE:
                return False
            return abs(process.create_time() - self.started) < START_TIME_TOLERANCE_S
        except psutil.NoSuchProcess:
            return False

    def is_self_or_ancestor(self) -> bool:
        """This very process, or one it descends from (on this host): the same run's own."""
        if self.alive() is not True:
            return False
        try:
            lineage = [psutil.Process(), *psutil.Process().parents()]
        except psutil.Error:
            return False
        return any(p.pid == self.pid for p in lineage)
