"""Progress of long work, reported through one callback type so the CLI (a rich bar) and Prefect
(progress artifacts) render the same updates. Phases call `report(...)`; they never print."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from pydantic import BaseModel, Field


class ProgressUpdate(BaseModel):
    phase: str = Field(description="Phase name, e.g. sampling.")
    stage: str = Field(description="What is progressing: weight load, requests, shards, steps.")
    done: float = Field(description="Units done.")
    total: float | None = Field(None, description="Units in all, when known.")
    unit: str = Field("", description="Unit name: shards, requests, steps.")
    rate: float | None = Field(None, description="Rate, in `rate_unit`.")
    rate_unit: str = Field("", description="Unit of `rate`, e.g. tok/s; empty: `unit` per second.")
    eta_s: float | None = Field(None, description="Seconds left, when known.")
    message: str = Field("", description="One line for the user.")

    def rate_text(self) -> str | None:
        """`32.7 tok/s`, `1.5 shards/s`: the rate with its unit, or None."""
        if self.rate is None:
            return None
        unit = self.rate_unit or f"{self.unit or 'units'}/s"
        return f"{self.rate:.1f} {unit}"

    def details(self) -> str:
        """What a bar does not already show: `85.5 tok/s · 0 errors`."""
        return " · ".join(part for part in (self.rate_text(), self.message) if part)

    def line(self) -> str:
        """One log line: `requests: 22/128 requests · 85.5 tok/s · ETA 12 s · 0 errors`."""
        total = f"/{self.total:g}" if self.total is not None else ""
        parts = [f"{self.stage}: {self.done:g}{total} {self.unit}".rstrip(), self.rate_text()]
        if self.eta_s is not None:
            parts.append(f"ETA {self.eta_s:.0f} s")
        parts.append(self.message)
        return " · ".join(part for part in parts if part)

    @property
    def percent(self) -> float | None:
        return 100.0 * self.done / self.total if self.total else None


ProgressCallback = Callable[[ProgressUpdate], None]


def ignore_progress(update: ProgressUpdate) -> None:
    """The callback of callers that show no progress."""


@contextmanager
def rich_progress(description: str = "") -> Iterator[ProgressCallback]:
    """A CLI progress bar fed by `ProgressUpdate`s: one bar per (phase, stage)."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[info]}"))
    bar = Progress(*columns, TimeRemainingColumn())
    tasks: dict[tuple[str, str], int] = {}

    def update(u: ProgressUpdate) -> None:
        key = (u.phase, u.stage)
        if not tasks:
            bar.start()  # on the first update: a command with nothing to show prints no empty bar
        if key not in tasks:
            tasks[key] = bar.add_task(f"{description}{u.phase}: {u.stage}", total=u.total, info="")
        bar.update(tasks[key], completed=u.done, total=u.total, info=u.details())

    try:
        yield update
    finally:
        if tasks:
            bar.stop()


class RateMeter:
    """Units per second over the whole run, for progress lines."""

    def __init__(self) -> None:
        self.start = time.monotonic()

    def rate(self, done: float) -> float:
        elapsed = time.monotonic() - self.start
        return done / elapsed if elapsed > 0 else 0.0

    def eta(self, done: float, total: float | None) -> float | None:
        rate = self.rate(done)
        return (total - done) / rate if total is not None and rate > 0 else None
