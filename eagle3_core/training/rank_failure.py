"""How a failed launch is told: torchrun keeps each rank's error record (`error.json`, written by torch's
`record` in `eagle3 train`) under `<log dir>/<run id>/attempt_<n>/<rank>/`, and its agent's output in
`torchrun.log`. `launch_failure` turns them into one `RankFailed`: the rank that failed first, its error,
traceback and log tail. The rank's exception, made again in this process, is its cause, so the task's retry
condition judges it as it would in-process (an injected fault or a bad input is not retried).
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path

from eagle3_core.serving.lifecycle import exit_description, log_excerpt

AGENT_LOG = "torchrun.log"
TRACEBACK_LINES = 30
# Where a rank's exception class may be looked up again in this process (`rank_exception`).
KNOWN_MODULES = ("builtins", "eagle3_core", "torch")


class RankFailed(RuntimeError):
    """A rank of a launched training failed; the message names it, its error and its log's last lines."""


@dataclass(frozen=True)
class RankError:
    """One rank's error record (`error.json`, written by torch's `record` in `eagle3 train`)."""

    rank: int
    message: str  # "ValueError: ..."
    traceback: str
    timestamp: int
    log: Path  # the rank's stderr


def rank_errors(log_dir: Path) -> list[RankError]:
    """The error records torchrun kept under `log_dir` (`<run id>/attempt_<n>/<rank>/error.json`), the
    first failure first. A record that cannot be read is left out."""
    errors = []
    for path in log_dir.glob("*/attempt_*/*/error.json"):
        try:
            record = json.loads(path.read_text())["message"]
            extra = record["extraInfo"]
            errors.append(
                RankError(
                    int(path.parent.name),
                    record["message"],
                    extra["py_callstack"],
                    int(extra["timestamp"]),
                    path.with_name("stderr.log"),
                )
            )
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return sorted(errors, key=lambda error: (error.timestamp, error.rank))


def exception_class_name(message: str, traceback: str) -> str | None:
    """The dotted class name of a rank's exception: `message` starts with its bare name (`PreflightError:
    ...`), and the traceback's line of that exception with the name as Python prints it
    (`eagle3_core.preflight.PreflightError: ...`; a builtin bare)."""
    bare = message.partition(":")[0]
    for line in reversed(traceback.splitlines()):
        name = line.partition(":")[0]
        if name == bare or name.endswith(f".{bare}"):
            return name
    return None


def rank_exception(error: RankError) -> BaseException | None:
    """The rank's exception made again here, of its own class (a builtin, or one of this package or torch)
    and with its text, so a retry condition can judge it; None where the class cannot be found."""
    name = exception_class_name(error.message, error.traceback)
    if name is None:
        return None
    module, _, class_name = name.rpartition(".")
    module = module or "builtins"
    if module.split(".")[0] not in KNOWN_MODULES:
        return None
    try:
        kind = getattr(importlib.import_module(module), class_name)
        exception = kind.__new__(kind)
        BaseException.__init__(exception, error.message.partition(": ")[2])
    except Exception:
        return None
    return exception if isinstance(exception, BaseException) else None


def last_lines(text: str, count: int) -> str:
    return "\n".join(text.rstrip().splitlines()[-count:])


def traceback_tail(traceback: str, count: int) -> str:
    """The last `count` lines of a traceback, under its `Traceback (most recent call last):` header, with `...`
    where frames were left out."""
    lines = traceback.rstrip().splitlines()
    if len(lines) <= count:
        return "\n".join(lines)
    return "\n".join([lines[0], "  ...", *lines[-count:]])


def launch_failure(returncode: int, log_dir: Path) -> RankFailed:
    """Why a launch ended with `returncode`: the first rank's error, its traceback and log tail, caused by
    that rank's exception; without an error record (a rank killed by a signal), the agent's log tail."""
    errors = rank_errors(log_dir)
    if not errors:
        return RankFailed(
            f"torchrun ended with {exit_description(returncode)}; no rank left an error record; "
            f"{log_excerpt(log_dir / AGENT_LOG)}"
        )
    first = errors[0]
    others = [error.rank for error in errors[1:]]
    failure = RankFailed(
        f"training rank {first.rank} failed: {first.message}"
        + (f" (then ranks {others} failed too)" if others else "")
        + f"\n{traceback_tail(first.traceback, TRACEBACK_LINES)}\nrank {first.rank}'s {log_excerpt(first.log)}"
    )
    failure.__cause__ = rank_exception(first)
    return failure
