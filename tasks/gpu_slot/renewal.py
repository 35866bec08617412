"""Keeping a held slot's lease, or stopping the phase that holds it before the lease runs out.

A Prefect server revokes a lease `LEASE_S` seconds after its last renewal and gives the slot to the next
waiter: a holder whose renewals fail must not go on using the accelerator past that. Prefect's own renewal
gives up after three failed attempts and, unless told to cancel, lets the holder run on without its slot.
Here the lease is renewed every tenth of its length, a failed renewal is tried again at the next turn (a busy
API is no reason to stop a long extraction), and once no renewal has succeeded for half the lease, the
holding thread gets `SlotLost` raised in it: the phase stops (its engine with it, in its own `finally`) with
half a lease left, before any other run can take the slot, and its task's retry takes the slot again. A lease
the server says it no longer has (`LeaseRevoked`) stops the phase at once. No Prefect import here: the
renewal itself is a callable."""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

RENEWALS_PER_LEASE = 10
GIVE_UP_SHARE = 0.5  # of the lease without a successful renewal


class SlotLost(RuntimeError):
    """The slot's lease could not be renewed for half its length: the phase holding it was stopped. Raised
    from outside, in the holding thread, it carries its default message (a block that holds the slot across
    calls, as the shared server does, meets it wherever that thread is)."""

    def __init__(self, message: str = "the slot's lease could not be renewed: stopped before it runs out") -> None:
        super().__init__(message)


class LeaseRevoked(Exception):
    """The server no longer knows the lease (it revoked it): the slot may be another run's already."""


def raise_in_thread(thread_id: int, exc_type: type[BaseException] | None) -> None:
    """Raise `exc_type` in the thread `thread_id` at its next Python instruction (None: cancel one pending)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread_id), ctypes.py_object(exc_type) if exc_type else None
    )


@contextmanager
def kept_lease(renew: Callable[[], None], lease_s: float, what: str = "the slot") -> Iterator[None]:
    """Renew a lease of `lease_s` seconds with `renew()` while the block runs; raise `SlotLost` in the block
    once renewals have failed for half the lease (the message names the last failure)."""
    holder = threading.get_ident()
    done = threading.Event()
    guard = threading.Lock()  # the block's end and the keeper's raise exclude each other
    failures: list[BaseException] = []

    def keep() -> None:
        renewed = time.monotonic()
        while not done.wait(lease_s / RENEWALS_PER_LEASE):
            try:
                renew()
                renewed = time.monotonic()
                failures.clear()
            except Exception as exc:  # any failure: the API unreachable, a 5xx, a revoked lease
                failures.append(exc)
                if isinstance(exc, LeaseRevoked) or time.monotonic() - renewed >= lease_s * GIVE_UP_SHARE:
                    with guard:
                        if not done.is_set():
                            raise_in_thread(holder, SlotLost)
                    return

    keeper = threading.Thread(target=keep, name="lease-keeper", daemon=True)
    keeper.start()
    try:
        yield
    except SlotLost:
        last = failures[-1] if failures else "no answer"
        how_long = "at once" if isinstance(last, LeaseRevoked) else f"for {lease_s * GIVE_UP_SHARE:.0f} s"
        raise SlotLost(
            f"{what}: its lease could not be renewed {how_long} (last failure: {last}); "
            f"stopped before the lease runs out and another run takes the slot (the phase resumes when run again)"
        ) from None
    finally:
        with guard:
            done.set()
            raise_in_thread(holder, None)  # a raise that came as the block ended is not this block's
        keeper.join()
