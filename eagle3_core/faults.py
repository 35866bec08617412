"""Fault injection for resume drills and tests: `EAGLE3_FAULT=<phase>:<point>` makes that phase fail at
that point with `InjectedFault`, the way a crash there would, so "resume after a failure" is tested with the
real phases rather than mocks. Several faults may be given, separated by commas.

Points:
- `start`: before the phase does any work.
- `end`: after the phase returned its manifest (the work is on disk, but the run never recorded it).
- `<unit>=<n>`, e.g. `sampling:requests=20`, `extraction:shards=1`, `training:steps=5`: at the first progress
  update of that unit (or stage) with done >= n, i.e. in the middle of the phase, after n units were reported.

Unset (the default), every check is a no-op.
"""

from __future__ import annotations

import os

from eagle3_core.progress import ProgressCallback, ProgressUpdate

ENV = "EAGLE3_FAULT"


class InjectedFault(RuntimeError):
    """The failure asked for by EAGLE3_FAULT; deterministic, so orchestration never retries it."""


def active_faults(phase: str) -> list[str]:
    """The points of `phase` named in EAGLE3_FAULT (`sampling:requests=20` -> ["requests=20"])."""
    faults = []
    for entry in os.environ.get(ENV, "").split(","):
        name, sep, point = entry.strip().partition(":")
        if sep and name == phase and point:
            faults.append(point)
    return faults


def check_fault(phase: str, point: str) -> None:
    """Raise `InjectedFault` if EAGLE3_FAULT names this phase and point."""
    if point in active_faults(phase):
        raise InjectedFault(f"{ENV}: injected failure in {phase} at {point}")


def faulting_progress(phase: str, callback: ProgressCallback) -> ProgressCallback:
    """Wrap a progress callback so a `<unit>=<n>` fault fires inside the phase, mid-work."""
    thresholds = {}
    for point in active_faults(phase):
        unit, sep, count = point.partition("=")
        if sep:
            thresholds[unit] = float(count)
    if not thresholds:
        return callback

    def report(update: ProgressUpdate) -> None:
        callback(update)
        for unit in (update.unit, update.stage):
            if unit in thresholds and update.done >= thresholds[unit]:
                raise InjectedFault(f"{ENV}: injected failure in {phase} at {unit}={update.done:g}")

    return report
