"""Fault injection for resume drills and tests: `EAGLE3_FAULT=<phase>:<point>` makes that phase fail at
that point with `InjectedFault`, the way a crash there would, so "resume after a failure" is tested with the
real phases rather than mocks. Several faults may be given, separated by commas.

Points:
- `start`: before the phase does any work.
- `end`: after the phase returned its manifest (the work is on disk, but the run never recorded it).
- `<unit>=<n>`, e.g. `sampling:requests=20`, `extraction:shards=1`, `training:steps=5`: at the first progress
  update of that unit (or stage) with done >= n, i.e. in the middle of the phase, after n units were reported.
- `kill-engine@<unit>=<n>`, e.g. `sampling:kill-engine@requests=8`: at that same point, SIGKILL the process
  group of every vLLM server this process started, and raise nothing: the phase meets a really dead engine.
  Fires once per process (a retry of the phase then runs undisturbed); `kill-engine-always@<unit>=<n>`
  fires in every attempt (once per progress callback, i.e. per phase run), to rehearse bounded retries.
- `kill-engine-core@<unit>=<n>`: the same, once per process, but SIGKILL only the server's child processes
  (the engine core and its workers), as the kernel's OOM killer would: the API server answers 5xx for a
  moment, then exits by itself.
- `kill-process@<unit>=<n>`: at that same point, SIGKILL this very process (the phase's own, e.g. a host's
  child flow run): no `finally`, no hook runs, as the OOM killer or a lost host would end it.

Unset (the default), every check is a no-op.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

import psutil

from eagle3_core.progress import ProgressCallback, ProgressUpdate

ENV = "EAGLE3_FAULT"
KILL_ENGINE = "kill-engine"
KILL_ENGINE_ALWAYS = "kill-engine-always"
KILL_ENGINE_CORE = "kill-engine-core"
KILL_PROCESS = "kill-process"
ENGINE_MODULE = "vllm.entrypoints.openai.api_server"
# Engine kills that fire once per process and already fired, by their EAGLE3_FAULT entry.
fired_kills: set[str] = set()


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


@dataclass(frozen=True)
class EngineKill:
    """A `kill-engine[-always|-core]@<unit>=<n>` point of one phase."""

    entry: str
    unit: str
    count: float
    always: bool
    core_only: bool
    whole_process: bool = False  # `kill-process@`: this process itself, not its engines

    def due(self, update: ProgressUpdate) -> bool:
        return update.done >= self.count and self.unit in (update.unit, update.stage)


def parse_engine_kill(phase: str, point: str) -> EngineKill | None:
    """`kill-engine@requests=8` (or `kill-process@...`) -> its EngineKill; any other point -> None."""
    action, sep, threshold = point.partition("@")
    unit, _, count = threshold.partition("=")
    actions = (KILL_ENGINE, KILL_ENGINE_ALWAYS, KILL_ENGINE_CORE, KILL_PROCESS)
    if not sep or action not in actions or not unit or not count:
        return None
    return EngineKill(
        f"{phase}:{point}",
        unit,
        float(count),
        action == KILL_ENGINE_ALWAYS,
        action == KILL_ENGINE_CORE,
        action == KILL_PROCESS,
    )


def kill_engines(core_only: bool = False) -> list[int]:
    """SIGKILL the process group of every vLLM server this process started (each runs in its own session;
    this process's own group is never signalled), or with `core_only` only each server's descendants.
    Returns the pids (groups) killed."""
    own_group = os.getpgrp()
    killed = []
    for child in psutil.Process().children():
        try:
            if ENGINE_MODULE not in child.cmdline() or (group := os.getpgid(child.pid)) == own_group:
                continue
            if not core_only:
                os.killpg(group, signal.SIGKILL)
                killed.append(group)
                continue
            for descendant in child.children(recursive=True):
                descendant.kill()
                killed.append(descendant.pid)
        except (psutil.Error, ProcessLookupError):
            continue
    return killed


def faulting_progress(phase: str, callback: ProgressCallback) -> ProgressCallback:
    """Wrap a progress callback so a `<unit>=<n>` fault fires inside the phase, mid-work, and a
    `kill-engine@<unit>=<n>` point kills the phase's engine there (`kill-process@`: the phase's process)."""
    thresholds = {}
    kills = []
    for point in active_faults(phase):
        if kill := parse_engine_kill(phase, point):
            kills.append(kill)
            continue
        unit, sep, count = point.partition("=")
        if sep:
            thresholds[unit] = float(count)
    if not thresholds and not kills:
        return callback
    fired_here: set[str] = set()

    def report(update: ProgressUpdate) -> None:
        callback(update)
        for kill in kills:
            done_before = fired_here if kill.always else fired_kills
            if kill.due(update) and kill.entry not in done_before:
                done_before.add(kill.entry)
                if kill.whole_process:
                    os.kill(os.getpid(), signal.SIGKILL)
                kill_engines(kill.core_only)
        for unit in (update.unit, update.stage):
            if unit in thresholds and update.done >= thresholds[unit]:
                raise InjectedFault(f"{ENV}: injected failure in {phase} at {unit}={update.done:g}")

    return report
