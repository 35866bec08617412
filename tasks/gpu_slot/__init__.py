"""The GPU slot, in one place: one engine owner at a time. Every phase that starts an inference engine or
trains holds one slot of the global concurrency limit `gpu` (`orchestration.gpu_limit`; strict: a missing
limit is an error, never a silent pass). The limit is created with one slot when it does not exist yet, so
a fresh Prefect (ephemeral or a new server) works. A holder killed outright never blocks the next run, and
a waiter says whom it waits for.

The package, read top down:
- here, the public surface: `phase_slot` (what a phase task holds), `gpu_slot` (hold a slot for a block),
  `ensure_concurrency_limit` (create the limit), and the records' types for the callers that read them;
- `leases`: the Prefect side: the limit, taking a slot (waiting for a live holder, giving back a dead
  one's), giving it back, and telling a dead holder (`death_of`);
- `records`: the holders on disk and their processes' liveness, pure bookkeeping without Prefect;
- `renewal`: keeping the held slot's lease, or stopping its holder (`SlotLost`) before the lease runs out."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from functools import partial
from uuid import UUID

import httpx
from prefect.client.orchestration import get_client

from eagle3_core.events import RunEvents
from eagle3_core.progress import ProgressCallback
from tasks.gpu_slot.leases import GPU_SLOTS, LEASE_S, death_of, ensure_concurrency_limit, give_back, take_slot
from tasks.gpu_slot.records import HolderBook, HolderRecord, ProcessIdentity
from tasks.gpu_slot.renewal import LeaseRevoked, SlotLost, kept_lease

__all__ = [
    "GPU_SLOTS",
    "LEASE_S",
    "HolderBook",
    "HolderRecord",
    "ProcessIdentity",
    "SlotLost",
    "death_of",
    "ensure_concurrency_limit",
    "gpu_slot",
    "phase_slot",
]

log = logging.getLogger("eagle3.gpu")
LEASE_GONE = (404, 410)  # what a Prefect server answers a renewal of a lease it expired or revoked


def waiting_progress() -> ProgressCallback:
    """Where waiting is reported: the task run's log (and a progress artifact), else this module's log."""
    try:
        from tasks.progress import PrefectProgress

        return PrefectProgress(interval_s=0)
    except Exception:  # no run context: a plain logger line
        return lambda update: log.info("%s: %s: %s", update.phase, update.stage, update.message)


def current_phase() -> str:
    from prefect.context import TaskRunContext

    context = TaskRunContext.get()
    return context.task.name if context is not None else "gpu"


@contextmanager
def gpu_slot(
    name: str, events: RunEvents | None = None, progress: ProgressCallback | None = None, phase: str | None = None
) -> Iterator[None]:
    """Hold one slot of `name` for the block. Waits while a live holder has it, saying so every few
    seconds; a dead holder's slot is given back first, with a `decision` line in `events`."""
    ensure_concurrency_limit(name)
    phase = phase or current_phase()
    book, lease_id = take_slot(name, events, phase, progress or waiting_progress(), time.sleep)
    try:
        # A renewal that fails once (a busy API) must not kill a 25-minute extraction mid-shard; one that
        # keeps failing stops the phase before the server gives the slot to another run.
        with kept_lease(partial(renew, lease_id), LEASE_S, f"the `{name}` slot of {phase}"):
            yield
    finally:
        give_back(book, lease_id)


def renew(lease_id: str) -> None:
    """Renew the lease; `LeaseRevoked` when the server no longer has it (410 Gone, or 404)."""
    with get_client(sync_client=True) as client:
        try:
            client.renew_concurrency_lease(lease_id=UUID(lease_id), lease_duration=LEASE_S)
        except httpx.HTTPStatusError as exc:
            if exc.response.status_code in LEASE_GONE:
                raise LeaseRevoked(f"lease {lease_id} is no longer on the server") from None
            raise


def phase_slot(name: str, shared: object | None, events: RunEvents | None = None) -> AbstractContextManager[None]:
    """The slot a phase holds: `gpu_slot(name)` when it starts its own engine; none when it uses a shared
    server (`shared` not None), which holds the slot itself from its start to its stop."""
    return nullcontext() if shared is not None else gpu_slot(name, events)
