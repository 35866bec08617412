"""Progress of a phase as Prefect progress artifacts: one artifact per (phase, stage) — weight load %,
requests, shards, training steps — updated at most every `interval_s` seconds (and always at the end of a
stage), so a phase reporting every request does not flood the API. Phases may report from helper threads
(the engine's log reader), so the adapter captures the task's context once and replays it on each call.
A failed update is logged and dropped: progress must never fail a 25-minute phase."""

from __future__ import annotations

import contextvars
import re
import threading
import time
from typing import Any
from uuid import UUID

from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.logging import get_run_logger

from eagle3_core.progress import ProgressUpdate


def artifact_key(phase: str, stage: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes only."""
    return re.sub(r"[^a-z0-9]+", "-", f"{phase}-{stage}".lower()).strip("-")


class PrefectProgress:
    """A `ProgressCallback` that feeds progress artifacts of the current task run."""

    def __init__(self, interval_s: float = 5.0):
        self.interval_s = interval_s
        self.context = contextvars.copy_context()
        self.logger = get_run_logger()
        self.artifacts: dict[tuple[str, str], UUID] = {}
        self.last_sent: dict[tuple[str, str], float] = {}
        self.lock = threading.Lock()  # updates arrive from several threads; one artifact per stage

    def __call__(self, update: ProgressUpdate) -> None:
        key = (update.phase, update.stage)
        finished = update.total is not None and update.done >= update.total
        with self.lock:
            now = time.monotonic()
            if not finished and now - self.last_sent.get(key, -float("inf")) < self.interval_s:
                return
            self.last_sent[key] = now
            try:
                self.context.copy().run(self.send, key, update)
            except Exception as exc:
                self.logger.warning("progress artifact not updated: %s", exc)

    def send(self, key: tuple[str, str], update: ProgressUpdate) -> Any:
        percent = min(100.0, update.percent) if update.percent is not None else 0.0
        description = update.line()
        self.logger.info("%s %s", update.phase, description)
        if key not in self.artifacts:
            self.artifacts[key] = create_progress_artifact(percent, key=artifact_key(*key), description=description)
        else:
            update_progress_artifact(self.artifacts[key], percent, description=description)
