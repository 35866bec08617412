"""The Prefect side of the slot: the global concurrency limit itself (created when missing), and taking a
slot of it so that a holder killed outright (SIGKILL, the OOM killer, a
lost host) never blocks the next run: every holder records itself (`tasks.gpu_slot.records`), and a waiter
gives back the slot of a holder that is gone, with one `decision` line in its run's events.jsonl. While it
waits for a live holder it says so every few seconds: who holds the slot, since when, how long so far.

How a dead holder's slot comes back depends on where its Prefect lease lives:
- ephemeral API (no PREFECT_API_URL, the default): each run's temporary server keeps leases in its own
  memory, and a server in ephemeral mode runs no lease repossessor, so a dead run's lease is gone with its
  server and its slot stays counted in the shared database. All holders of that database run on this host
  under this PREFECT_HOME, and every one records itself under the book's lock, so the slots counted beyond
  the live holders on record are dead: they are decremented (`/v2/concurrency_limits/decrement`).
- a Prefect server (PREFECT_API_URL): the lease lives on the server. A dead holder of this host is released
  through its own lease (`decrement-with-lease`: exact, and a no-op if the server already revoked it);
  holders of other hosts are left to the server's repossessor, which revokes a lease LEASE_S seconds after
  its holder last renewed it. Counting is never used there: the server's other hosts' holders are not
  on record here.
Two live holders never share a slot: a holder takes its slot and writes its record inside the same lock
the waiter reads the records in, and a live holder's slot is never given back."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from uuid import UUID

import httpx
from prefect.client.orchestration import SyncPrefectClient, get_client
from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
from prefect.concurrency._asyncio import ConcurrencySlotAcquisitionError
from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound
from prefect.settings import get_current_settings

from eagle3_core.events import DECISION, RunEvents
from eagle3_core.progress import ProgressCallback, ProgressUpdate
from tasks.gpu_slot.records import HolderBook, HolderRecord, ProcessIdentity, waiting_text

GPU_SLOTS = 1
LEASE_S = 300.0
POLL_S = 2.0  # between attempts while a live holder has the slot
REPORT_S = 5.0  # between progress lines while waiting
HTTP_LOCKED = 423

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


def ephemeral_api() -> bool:
    """No PREFECT_API_URL: each run talks to a temporary server of its own over the shared database."""
    return not get_current_settings().api.url


def holder_book(limit: str) -> HolderBook:
    """The records of `limit`'s holders: under PREFECT_HOME (next to the ephemeral database), per API."""
    api = get_current_settings().api.url
    scope = "ephemeral" if not api else re.sub(r"[^A-Za-z0-9]+", "-", api).strip("-")
    return HolderBook(Path(get_current_settings().home) / "eagle3-slot-holders" / scope / limit)


def current_flow_run() -> tuple[str | None, str | None]:
    from prefect.runtime import flow_run

    return (flow_run.id or None, flow_run.name or None)


def try_take(client: SyncPrefectClient, limit: str) -> str | None:
    """One attempt at a slot: its lease id, or None while the limit is full."""
    from prefect.client.schemas.objects import ConcurrencyLeaseHolder

    flow_run_id, _ = current_flow_run()
    holder = ConcurrencyLeaseHolder(type="flow_run", id=UUID(flow_run_id)) if flow_run_id else None
    try:
        response = client.increment_concurrency_slots_with_lease(
            names=[limit], slots=1, mode="concurrency", lease_duration=LEASE_S, holder=holder
        )
    except httpx.HTTPStatusError as exc:
        if exc.response.status_code == HTTP_LOCKED:
            return None
        raise
    body = response.json()
    if not body.get("limits"):
        raise ConcurrencySlotAcquisitionError(f"global concurrency limit {limit!r} does not exist")
    return str(body["lease_id"])


def record_of(limit: str, lease_id: str) -> HolderRecord:
    me = ProcessIdentity.current()
    flow_run_id, flow_run_name = current_flow_run()
    return HolderRecord(limit, lease_id, flow_run_id, flow_run_name, me.host, me.pid, me.started, time.time())


def death_of(client: SyncPrefectClient, record: HolderRecord) -> str | None:
    """Why the holder is dead, or None while it may be alive: its process is gone (this host), or, on
    another host, its flow run has ended (a run in a final state has left its phases, slots included).
    Unknown counts as alive."""
    alive = record.process.alive()
    if alive is not None:
        return None if alive else "that process is gone"
    if record.flow_run_id is None:
        return None
    try:
        state = client.read_flow_run(UUID(record.flow_run_id)).state
    except ObjectNotFound:
        return None
    return f"that flow run ended ({state.name})" if state is not None and state.is_final() else None


def release_dead(client: SyncPrefectClient, book: HolderBook, limit: str, events: RunEvents | None, phase: str) -> bool:
    """Give back the slots of dead holders (called under the book's lock). True if any was given back."""
    records = book.records()
    deaths = {r.lease_id: why for r in records if (why := death_of(client, r)) is not None}
    dead = [r for r in records if r.lease_id in deaths]
    live = [r for r in records if r.lease_id not in deaths]
    for record in dead:
        book.remove(record.lease_id)
    if not ephemeral_api():
        for record in dead:
            client.release_concurrency_slots_with_lease(UUID(record.lease_id))
            why = f"{deaths[record.lease_id]}; its Prefect lease was revoked"
            note(events, phase, f"released the `{limit}` slot of {record.describe()}: {why}", record)
        return bool(dead)
    active = client.read_global_concurrency_limit_by_name(limit).active_slots
    excess = active - len(live)
    if excess <= 0:
        return False
    client.release_concurrency_slots([limit], excess, occupancy_seconds=1.0)
    for record in dead[:excess]:
        why = f"{deaths[record.lease_id]}, and its lease died with its temporary Prefect server"
        note(events, phase, f"released the `{limit}` slot of {record.describe()}: {why}", record)
    if excess > len(dead):
        unknown = "no holder on record: a run killed before it recorded itself, or one of an older version"
        note(events, phase, f"released {excess - len(dead)} `{limit}` slot(s) that no live process holds ({unknown})")
    return True


def note(events: RunEvents | None, phase: str, message: str, record: HolderRecord | None = None) -> None:
    fields = {}
    if record is not None:
        fields = {
            "holder_pid": record.pid,
            "holder_host": record.host,
            "holder_flow_run": record.flow_run_id,
            "holder_since": record.since,
            "lease_id": record.lease_id,
        }
    if events is not None:
        events.record(phase, DECISION, message, **fields)
    else:
        log.warning(message)


def waiting_message(book: HolderBook, waited_s: float) -> str:
    live = [r for r in book.records() if r.process.alive() is not False]
    return waiting_text(live, waited_s, LEASE_S)


def take_slot(
    limit: str, events: RunEvents | None, phase: str, progress: ProgressCallback, sleep: Callable[[float], None]
) -> tuple[HolderBook, str]:
    """Wait for a slot of `limit` (giving back dead holders' slots first); returns (book, lease id)."""
    book = holder_book(limit)
    started = time.monotonic()
    last_report = -float("inf")
    with get_client(sync_client=True) as client:
        while True:
            with book.locked():
                lease_id = try_take(client, limit)
                if lease_id is not None:
                    try:
                        book.write(record_of(limit, lease_id))
                    except BaseException:  # a holder off the record could be counted dead: never hold so
                        client.release_concurrency_slots_with_lease(UUID(lease_id))
                        raise
                    return book, lease_id
                if release_dead(client, book, limit, events, phase):
                    continue
            now = time.monotonic()
            if now - last_report >= REPORT_S:
                last_report = now
                stage = f"waiting for the {limit} slot"
                message = waiting_message(book, now - started)
                progress(ProgressUpdate(phase=phase, stage=stage, done=round(now - started), unit="s", message=message))
            sleep(POLL_S)


def give_back(book: HolderBook, lease_id: str) -> None:
    """Release the slot, then drop its record (a record without a slot is harmless; the reverse is not)."""
    with get_client(sync_client=True) as client:
        client.release_concurrency_slots_with_lease(UUID(lease_id))
    book.remove(lease_id)
