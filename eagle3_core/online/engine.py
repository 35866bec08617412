"""The extraction engine as online training's `StatesSource`: the same backend offline extraction opens
(vLLM's `extract_hidden_states` server and connector, a shared sampling server, or transformers), started by
`start()` in the phase's own thread (a server started there dies with the process: its parent-death signal is
armed only from the main thread), restarted once when it dies while training waits, and failing the phase
with the engine's log tail when it dies a second time. A restart happens in the thread that saw the death:
that server has no parent-death signal, and the next run or the flow's hooks stop it by its pid file."""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack

from eagle3_core.events import DECISION, RunEvents
from eagle3_core.hidden_states.storage import ExtractionBackend, SampleRow, SampleStates
from eagle3_core.phases import TRAINING
from eagle3_core.serving.engine import EngineDied

RESTARTS = 1
EngineOpener = Callable[[], AbstractContextManager[ExtractionBackend]]


class EngineSource:
    """`extract(rows)` on the engine `open_engine` starts (see the module docstring); safe to call from
    several threads: the first request to see a death restarts the engine, the others retry on it."""

    def __init__(self, open_engine: EngineOpener, events: RunEvents, restarts: int = RESTARTS):
        self.open_engine = open_engine
        self.events = events
        self.restarts = restarts
        self.deaths = 0
        self.closed = False  # a request still in flight when training ends restarts nothing
        self._stack: ExitStack | None = None
        self._backend: ExtractionBackend | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        """Start the engine now, in this thread, unless one runs."""
        self._running()

    def _running(self) -> tuple[ExtractionBackend, int]:
        """The running engine (started here when none runs) and the deaths counted when it was asked for."""
        with self._lock:
            if self.closed:
                raise EngineDied("the extraction engine was stopped: training ended")
            if self.deaths > self.restarts:
                raise EngineDied("the extraction engine died after its restart; training stopped")
            if self._backend is None:
                stack = ExitStack()
                self._backend = stack.enter_context(self.open_engine())
                self._stack = stack
            return self._backend, self.deaths

    def extract(self, rows: list[SampleRow]) -> tuple[list[SampleStates], object | None]:
        while True:
            backend, deaths = self._running()
            try:
                return backend.extract(rows)
            except EngineDied as exc:
                self._died(deaths, exc)

    def _died(self, deaths: int, exc: EngineDied) -> None:
        """Count the death `exc` once (a request that saw the same engine die returns to retry), stop what is
        left of the engine, and fail when it was the restarted one."""
        with self._lock:
            if deaths != self.deaths or self.closed:
                return
            self.deaths += 1
            self._stop()
            reason = str(exc).splitlines()[0]
            if self.deaths > self.restarts:
                self.events.record(TRAINING.name, DECISION, f"the extraction engine died again after its restart "
                                   f"({reason}); online training stops", reason=str(exc))  # fmt: skip
                raise EngineDied(f"the extraction engine died again after its restart; training stopped: {exc}")
            self.events.record(TRAINING.name, DECISION, f"the extraction engine died ({reason}); restarting it "
                               "once, training waits for it", reason=str(exc))  # fmt: skip

    def _stop(self) -> None:
        stack, self._stack, self._backend = self._stack, None, None
        if stack is not None:
            stack.close()

    def close(self) -> None:
        """Stop the engine, if one runs."""
        with self._lock:
            self.closed = True
            self._stop()

    def __enter__(self) -> EngineSource:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
