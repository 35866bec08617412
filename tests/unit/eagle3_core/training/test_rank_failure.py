"""How a failed launch is told (`eagle3_core.training.rank_failure`), from error records laid out as torchrun
keeps them: the first failed rank with its error, traceback and log tail, its exception as the cause the
retry policy judges, and the agent's log where no rank left a record."""

from __future__ import annotations

import json
from pathlib import Path

from eagle3_core.faults import InjectedFault
from eagle3_core.training.rank_failure import AGENT_LOG, RankFailed, launch_failure
from tasks.policy import is_deterministic


def error_record(log_dir: Path, rank: int, exception: BaseException, timestamp: int) -> None:
    """The error.json torch's `record` writes for a rank, as torchrun lays it out."""
    rank_dir = log_dir / "run-1_abc" / "attempt_0" / str(rank)
    rank_dir.mkdir(parents=True)
    name = type(exception).__name__
    qualified = name if type(exception).__module__ == "builtins" else f"{type(exception).__module__}.{name}"
    callstack = f'Traceback (most recent call last):\n  File "x.py", line 1, in <module>\n{qualified}: {exception}\n'
    record = {"message": f"{name}: {exception}", "extraInfo": {"py_callstack": callstack, "timestamp": str(timestamp)}}
    (rank_dir / "error.json").write_text(json.dumps({"message": record}))
    (rank_dir / "stderr.log").write_text(f"rank {rank} starting\nrank {rank} last words\n")


def test_the_first_failed_rank_fails_the_task_with_its_error_and_log(tmp_path: Path) -> None:
    error_record(tmp_path, 1, InjectedFault("EAGLE3_FAULT: injected failure in training at start"), 100)
    error_record(tmp_path, 0, RuntimeError("Connection closed by peer"), 101)
    failure = launch_failure(1, tmp_path)
    assert isinstance(failure, RankFailed)
    message = str(failure)
    assert message.startswith("training rank 1 failed: InjectedFault: EAGLE3_FAULT: injected failure")
    assert "(then ranks [0] failed too)" in message
    assert "eagle3_core.faults.InjectedFault" in message, "its traceback"
    assert "rank 1 last words" in message, "its log's tail"
    assert isinstance(failure.__cause__, InjectedFault)
    assert is_deterministic(failure), "an injected fault in a rank is not retried"


def test_a_rank_that_failed_transiently_is_retried(tmp_path: Path) -> None:
    error_record(tmp_path, 0, RuntimeError("NCCL watchdog timeout"), 100)
    failure = launch_failure(1, tmp_path)
    assert type(failure.__cause__) is RuntimeError and not is_deterministic(failure)


def test_a_rank_of_unknown_kind_is_told_without_a_cause(tmp_path: Path) -> None:
    class Strange(Exception):
        __module__ = "somewhere.else"

    error_record(tmp_path, 0, Strange("odd"), 100)
    failure = launch_failure(1, tmp_path)
    assert failure.__cause__ is None and "Strange: odd" in str(failure)


def test_a_rank_killed_without_an_error_record_is_told_by_the_agent_log(tmp_path: Path) -> None:
    (tmp_path / AGENT_LOG).write_text("rank: 1 (local_rank: 1)\nexitcode: -9 (pid: 4242)\nSignal 9 (SIGKILL)\n")
    message = str(launch_failure(1, tmp_path))
    assert "torchrun ended with exit code 1; no rank left an error record" in message
    assert "Signal 9 (SIGKILL)" in message
