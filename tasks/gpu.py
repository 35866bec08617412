"""One engine owner at a time: every phase that starts an inference engine or trains holds one slot of the
global concurrency limit `gpu` (strict: a missing limit is an error, never a silent pass). The limit is
created with one slot when it does not exist yet, so a fresh Prefect (ephemeral or a new server) works.
A holder killed outright never blocks the next run, and a waiter says whom it waits for: `tasks.gpu_holders`."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext, suppress
from uuid import UUID

from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
from prefect.concurrency._leases import maintain_concurrency_lease
from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

from eagle3_core.events import RunEvents
from eagle3_core.progress import ProgressCallback
from tasks.gpu_holders import LEASE_S, give_back, take_slot

GPU_SLOTS = 1

log = logging.getLogger("eagle3.gpu")


def ensure_concurrency_limit(name: str, limit: int = GPU_SLOTS) -> int:
    """Create the global concurrency limit `name` with `limit` slots unless it exists; return its limit."""
    with get_client(sync_client=True) as client:
        try:
            return client.read_global_concurrency_limit_by_name(name).limit
        except ObjectNotFound:
            pass
        with suppress(ObjectAlreadyExists):  # another flow created it between the read and the create
            client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=limit))
        return client.read_global_concurrency_limit_by_name(name).limit


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
        # A lease renewal that fails once (a busy API) must not kill a 25-minute extraction mid-shard.
        with maintain_concurrency_lease(UUID(lease_id), LEASE_S, raise_on_lease_renewal_failure=False):
            yield
    finally:
        give_back(book, lease_id)


def phase_slot(name: str, shared: object | None, events: RunEvents | None = None) -> AbstractContextManager[None]:
    """The slot a phase holds: `gpu_slot(name)` when it starts its own engine; none when it uses a shared
    server (`shared` not None), which holds the slot itself from its start to its stop."""
    return nullcontext() if shared is not None else gpu_slot(name, events)
