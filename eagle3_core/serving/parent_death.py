"""Child processes that end with the process that started them, even when it dies without running any
`finally` (SIGKILL, the OOM killer): Linux's parent-death signal, `prctl(PR_SET_PDEATHSIG)`, set in the
child between fork and exec (a `preexec_fn`).

The kernel sends that signal when the *thread* that forked the child ends, not the process: it is set
only when the caller is the main thread (which ends with the process). Elsewhere (a phase run in a helper
thread) the child is left to the next run's clean-up, which finds it by its pid file or record."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
import threading
from collections.abc import Callable

PR_SET_PDEATHSIG = 1


def libc_prctl() -> Callable[..., int] | None:
    """libc's `prctl`, or None where there is none (not Linux, no libc)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def die_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A `preexec_fn` giving the child `sig` when this process dies; None where it cannot be set (not
    Linux, no libc, not the main thread)."""
    prctl = libc_prctl()
    if prctl is None or threading.current_thread() is not threading.main_thread():
        return None
    parent = os.getpid()

    def preexec() -> None:  # runs in the child, before exec: no imports, no locks
        prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the signal was armed
            os.kill(os.getpid(), sig)

    return preexec


def die_with_launcher(sig: int = signal.SIGTERM) -> bool:
    """The same signal armed from inside a child whose start we do not control (a torchrun worker: its
    agent forks it from its main thread): `sig` when the parent dies. A child whose parent already died
    (re-parented to init) gets it at once. False where it cannot be set."""
    prctl = libc_prctl()
    if prctl is None:
        return False
    prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    if os.getppid() == 1:
        os.kill(os.getpid(), sig)
    return True
