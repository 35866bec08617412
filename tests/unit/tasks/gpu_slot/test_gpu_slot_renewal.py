"""A held slot's lease: renewals that fail now and then keep the phase running; renewals that keep failing
stop the phase (`SlotLost`, naming the failure) with half the lease left, before another run could take it;
a lease the server no longer has stops it at once."""

from __future__ import annotations

import time
from uuid import uuid4

import pytest

from eagle3_core.events import RunEvents
from tasks.gpu_slot import gpu_slot, renew
from tasks.gpu_slot.leases import holder_book
from tasks.gpu_slot.renewal import LeaseRevoked, SlotLost, kept_lease


def busy_phase(seconds: float) -> None:
    """A phase's work: Python steps (the keeper's raise lands between two of them)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(0.01)


def test_renewals_that_keep_failing_stop_the_phase_before_the_lease_runs_out():
    lease_s = 1.0
    renewed: list[float] = []

    def unreachable() -> None:
        renewed.append(time.monotonic())
        raise ConnectionError("Prefect API unreachable")

    begun = time.monotonic()
    expected = r"the `gpu` slot of sampling: its lease could not be renewed for 0 s"
    with (
        pytest.raises(SlotLost, match=expected) as lost,
        kept_lease(unreachable, lease_s, "the `gpu` slot of sampling"),
    ):
        busy_phase(10)
    stopped_after = time.monotonic() - begun
    assert lease_s * 0.5 <= stopped_after < lease_s, "stopped too late: the server may have given the slot away"
    assert "Prefect API unreachable" in str(lost.value) and len(renewed) >= 4, "one failure is no reason to stop"


def test_renewals_failing_now_and_then_keep_the_phase_and_nothing_is_raised_after_the_block():
    calls = iter([ConnectionError("busy"), None, ConnectionError("busy"), None] * 20)

    def flaky() -> None:
        outcome = next(calls)
        if outcome is not None:
            raise outcome

    with kept_lease(flaky, 1.0):
        busy_phase(1.5)
    busy_phase(0.3)  # no late raise reaches the code after the block


def test_a_lease_the_server_revoked_stops_the_phase_at_the_next_renewal():
    def revoked() -> None:
        raise LeaseRevoked("lease 1 is no longer on the server")

    begun = time.monotonic()
    with pytest.raises(SlotLost, match="could not be renewed at once"), kept_lease(revoked, 10.0):
        busy_phase(10)
    assert time.monotonic() - begun < 3, "waited for half the lease although the slot may be another run's"


def test_renewing_a_held_lease_on_a_real_server_and_one_it_revoked(prefect_api, tmp_path):
    limit = f"gpu-{uuid4().hex[:8]}"
    with gpu_slot(limit, RunEvents(tmp_path), phase="sampling"):
        [record] = holder_book(limit).records()
        renew(record.lease_id)  # the slot's own lease: renewed
    with pytest.raises(LeaseRevoked, match="is no longer on the server"):
        renew(record.lease_id)  # given back with the slot
