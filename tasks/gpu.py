"""One engine owner at a time: every phase that starts an inference engine or trains holds one slot of the
global concurrency limit `gpu` (strict: a missing limit is an error, never a silent pass). The limit is
created with one slot when it does not exist yet, so a fresh Prefect (ephemeral or a new server) works."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext, suppress

from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
from prefect.concurrency.sync import concurrency
from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

GPU_SLOTS = 1
LEASE_S = 300.0


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


@contextmanager
def gpu_slot(name: str) -> Iterator[None]:
    """Hold one slot of `name` for the block (waits while another flow holds it)."""
    ensure_concurrency_limit(name)
    # A lease renewal that fails once (a busy API) must not kill a 25-minute extraction mid-shard.
    with concurrency(name, occupy=1, strict=True, lease_duration=LEASE_S, raise_on_lease_renewal_failure=False):
        yield


def phase_slot(name: str, shared: object | None) -> AbstractContextManager[None]:
    """The slot a phase holds: `gpu_slot(name)` when it starts its own engine; none when it uses a shared
    server (`shared` not None), which holds the slot itself from its start to its stop."""
    return nullcontext() if shared is not None else gpu_slot(name)
