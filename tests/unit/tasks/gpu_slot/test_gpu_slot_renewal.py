"""A held slot's lease: renewals that fail now and then keep the phase running; renewals that keep failing
stop the phase (`SlotLost`, naming the failure) with half the lease left, before another run could take it."""

from __future__ import annotations

import time

import pytest

from tasks.gpu_slot.renewal import SlotLost, kept_lease


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
