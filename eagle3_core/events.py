"""The run's decision log, `events.jsonl`: one JSON line per decision a phase takes (cache hit, resume
point, full weight load with its duration, engine start and stop). Users read it to know what happened;
tests count its lines (a full weight load is the expensive event the product promises to avoid)."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

log = logging.getLogger("eagle3")

CACHE_HIT = "cache_hit"
RESUME = "resume"
WEIGHT_LOAD = "weight_load"
ENGINE_START = "engine_start"
ENGINE_STOP = "engine_stop"
DECISION = "decision"
PREFLIGHT = "preflight"


def parsed_lines(text: str) -> Iterator[dict[str, Any]]:
    """The JSON objects of an events.jsonl text; a line torn by a short write (a full disk, a kill) is
    skipped, so one damaged line never makes the log unreadable."""
    for line in text.splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and "event" in event and "phase" in event:
            yield event


def ends_torn(fd: int) -> bool:
    """Whether the file open at `fd` ends in a line a short write left without its newline."""
    size = os.fstat(fd).st_size
    return size > 0 and os.pread(fd, 1, size - 1) != b"\n"


class RunEvents:
    """Appends to `<run_dir>/events.jsonl`. Each line is written with one O_APPEND write, so lines from
    concurrent processes never interleave; a line after a torn one starts on a line of its own."""

    def __init__(self, run_dir: Path | str):
        self.path = Path(run_dir) / "events.jsonl"

    def record(self, phase: str, event: str, message: str, **fields: Any) -> None:
        line = {"ts": time.time(), "phase": phase, "event": event, "message": message, **fields}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            text = json.dumps(line, default=str) + "\n"
            os.write(fd, (("\n" if ends_torn(fd) else "") + text).encode())
        finally:
            os.close(fd)
        log.info("[%s] %s", phase, message)

    @contextmanager
    def weight_load(self, phase: str, what: str) -> Iterator[None]:
        """Time a full weight load of the target and record it once it succeeds."""
        start = time.monotonic()
        yield
        seconds = time.monotonic() - start
        self.record(phase, WEIGHT_LOAD, f"loaded {what} in {seconds:.1f} s", what=what, seconds=seconds)

    def read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        return list(parsed_lines(self.path.read_text(errors="replace")))

    def count(self, event: str, phase: str | None = None) -> int:
        return sum(1 for e in self.read() if e["event"] == event and (phase is None or e["phase"] == phase))
