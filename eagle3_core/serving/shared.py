"""One vLLM server for sampling and extraction (`extraction.reuse_sampling_server`): one weight load
instead of two.

The server is an extraction server (`extract_hidden_states` method, our hidden-states connector) that
also generates: sampling requests ask for no states, so the connector writes nothing for them, and
extraction's prefill-only requests (which do ask) get their states written as usual.

Lifetime. The flow creates a `SharedServer` before sampling and hands it to the sampling and extraction
tasks as a parameter that is part of no cache key; each phase keeps its own manifest, cache key and
resume. The server starts lazily: the first phase that actually has work calls `running()` (one weight
load, recorded by `VllmServer`), so a phase whose result is cached never starts it. `running()` checks
the server on every use: a dead one, or one whose context is too short for the longest sample, is
stopped and started again (a new, recorded weight load). `hold` (the Prefect `gpu` slot, given by
tasks/) is entered just before the first start and released by `stop()`, after the server is gone: the
phases using the shared server take no slot of their own. The flow calls `stop()` right after extraction
and in a `finally`; the server's pid file (`<run_dir>/server/<phase>.pid`) lets the flow's crash hooks
and the next start stop it if this process dies first.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack, nullcontext
from typing import Any, Protocol

from eagle3_core.events import DECISION, RunEvents
from eagle3_core.progress import ProgressCallback, ignore_progress

# Tokens of context beyond what a sampled conversation may hold: the one token extraction generates, plus room
# for the chat template's end-of-turn tokens that follow a completion cut at the length limit.
CONTEXT_MARGIN = 16


def conversation_tokens(max_model_len: int, target_context: int | None) -> int:
    """Tokens a sampled conversation may hold: `server.max_model_len`, or less where the target's own context
    (`target_context`, config.json's max_position_embeddings, past which vLLM refuses to start) leaves no
    CONTEXT_MARGIN above it: the extraction server, shared or not, must hold every conversation plus the margin."""
    if target_context is None:
        return max_model_len
    return min(max_model_len, target_context - CONTEXT_MARGIN)


class Server(Protocol):
    base_url: str
    api_key: str | None
    process: Any

    def healthy(self) -> bool: ...

    def exit_report(self, wait_s: float = 0) -> str | None: ...

    def stop(self) -> None: ...


Launch = Callable[[str, ProgressCallback, int], Server]


def is_alive(server: Server) -> bool:
    """The server's process still runs and `/health` answers."""
    return server.process is not None and server.process.poll() is None and server.healthy()


class SharedServer:
    """A lazily started server shared by phases. `launch(phase, progress, context)` starts a server with
    `context` tokens of context and returns it running."""

    def __init__(
        self,
        launch: Launch,
        context: int,
        events: RunEvents,
        hold: Callable[[], AbstractContextManager[Any]] = nullcontext,
    ):
        self.launch = launch
        self.context = context
        self.events = events
        self.hold = hold
        self.server: Server | None = None
        self.slot = ExitStack()
        self.holding = False

    def running(self, phase: str, progress: ProgressCallback = ignore_progress, context: int = 0) -> Server:
        """The running server, started on first use; restarted when it died or when `context` tokens
        do not fit it."""
        if self.server is not None and not is_alive(self.server):
            self.events.record(phase, DECISION, "shared vLLM server is not alive; starting it again")
            self.stop_server()
        if self.server is not None and context > self.context:
            self.events.record(
                phase,
                DECISION,
                f"shared vLLM server holds {self.context} tokens, {context} needed; starting it again wider",
                context=context,
            )
            self.stop_server()
        if self.server is None:
            if not self.holding:
                self.slot.enter_context(self.hold())
                self.holding = True
            self.context = max(self.context, context)
            self.server = self.launch(phase, progress, self.context)
        return self.server

    def stop_server(self) -> None:
        server, self.server = self.server, None
        if server is not None:
            server.stop()

    def stop(self) -> None:
        """Stop the server (if started), then release `hold`. Safe to call twice."""
        try:
            self.stop_server()
        finally:
            self.holding = False
            self.slot.close()


def running_server(server: Any, phase: str, progress: ProgressCallback = ignore_progress, context: int = 0) -> Any:
    """The running server behind `server`: a SharedServer's (started or restarted as needed), or the
    server itself when it was handed in running."""
    return server.running(phase, progress, context) if isinstance(server, SharedServer) else server


def starts_engine(server: Any) -> bool:
    """Whether a phase handed `server` starts an engine before its work: with none handed in it starts its
    own, and the first phase to use a SharedServer starts that one; so either runs the engine checks of its
    preflight (port, free GPUs, tensor parallelism), which a server handed in running needs no more."""
    return server is None or (isinstance(server, SharedServer) and server.server is None)
