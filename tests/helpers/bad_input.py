"""The bad-input and fault matrix's parts (tests/unit/cli/test_bad_input_matrix.py): a row (`Case`) is an input
or fault, the `eagle3` command that meets it and the one error line it must end with; `files_state` is what
"nothing already written lost" is checked against: every file's bytes and mtime, before and after;
`run_dir_holder` is a second writer of a run folder."""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from typer.testing import Result


@dataclass
class Workspace:
    """One row's folder: `run` is its run_dir, `target` its target folder (a copy where the row breaks it),
    `tmp` holds both and whatever else the row writes; `cleanups` run after the row (a holder to stop)."""

    tmp: Path
    run: Path
    target: Path
    cleanups: list[Callable[[], None]] = field(default_factory=list)

    def fill(self, text: str) -> str:
        return text.format(tmp=self.tmp, run=self.run, target=self.target)


def no_fault(workspace: Workspace) -> None:
    """A row whose bad input is all in its command line."""


@dataclass(frozen=True)
class Case:
    """One row. `args`: the command line (`{tmp}`, `{run}`, `{target}` filled in); `error`: a regex the
    error's text must match (whitespace collapsed); `fault`: what the row breaks or writes first; `upstream`:
    the run_dir starts with samples, hidden states and a vocab; `own_target`: the row gets its own copy of
    the target to break; `check`: anything more to assert after the command (what must not have happened)."""

    name: str
    args: list[str]
    error: str
    fault: Callable[[Workspace], None] = no_fault
    upstream: bool = False
    own_target: bool = False
    check: Callable[[Workspace], None] = no_fault


FileState = tuple[str, int, int]  # sha256, mtime (ns), size


def files_state(root: Path) -> dict[str, FileState]:
    """Every file under `root` by relative path: its sha256, mtime and size."""
    return {
        str(path.relative_to(root)): (sha256(path.read_bytes()), path.stat().st_mtime_ns, path.stat().st_size)
        for path in sorted(root.rglob("*"))
        if path.is_file()
    }


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


APPEND_ONLY = ("events.jsonl",)  # logs: a refused command may add its lines, never change one
BOOKKEEPING = (".writer.lock",)  # the run folder's lock names its latest holder


def changed_files(before: dict[str, FileState], root: Path) -> list[str]:
    """The files of `before` that are gone or differ now (new files are not counted; a log that only grew
    has not changed)."""
    after = files_state(root)
    changed = [name for name, state in before.items() if after.get(name) != state]
    return [name for name in changed if Path(name).name not in BOOKKEEPING and not grew(root, name, before)]


def grew(root: Path, name: str, before: dict[str, FileState]) -> bool:
    """An append-only log whose old bytes are all still there, first."""
    path = root / name
    if Path(name).name not in APPEND_ONLY or not path.is_file():
        return False
    return sha256(path.read_bytes()[: before[name][2]]) == before[name][0]


HOLD = (
    "import sys, time; from eagle3_core.run_lock import run_dir_lock; from eagle3_core.hosts import HostSlice\n"
    "part = None if sys.argv[2] == '-' else HostSlice(int(sys.argv[2]), 2)\n"
    "with run_dir_lock(sys.argv[1], part, sys.argv[3:]):\n"
    "    print('held', flush=True); time.sleep(300)\n"
)


def run_dir_holder(run_dir: Path, command: list[str], host: int | None = None) -> subprocess.Popen:
    """Another process writing `run_dir` (of host `host` of 2's slice) as `command` would, until killed."""
    argv = [sys.executable, "-c", HOLD, str(run_dir), "-" if host is None else str(host), *command]
    holder = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    return holder


def error_text(result: Result) -> str:
    """The error a refused command ends with: exit status 1, no traceback, exactly one `error:` line (a
    config error lists its fields on the lines below it); its text, whitespace collapsed."""
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit), f"the error escaped as a traceback: {result.exception!r}"
    assert "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1, result.output
    return re.sub(r"\s+", " ", "\n".join(lines[lines.index(errors[0]) :]))
