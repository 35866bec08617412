"""The holders of a slot on disk and their liveness, no Prefect (`tasks.gpu_slot.records`): a process told
apart from a later one with its pid, one record per lease, and what a waiter says about the holders."""

from __future__ import annotations

from pathlib import Path

from tasks.gpu_slot.records import HolderBook, HolderRecord, ProcessIdentity, waiting_text
from tests.helpers.processes import dead_pid


def test_a_process_is_alive_until_it_is_gone_or_its_pid_is_reused():
    me = ProcessIdentity.current()
    assert me.alive() is True
    assert ProcessIdentity(me.host, me.pid, me.started - 5).alive() is False, "same pid, older process: reused"
    assert ProcessIdentity(me.host, dead_pid(), me.started).alive() is False
    assert ProcessIdentity("another-host", me.pid, me.started).alive() is None, "cannot be told from here"


def test_the_book_keeps_one_record_per_lease_and_drops_a_damaged_one(tmp_path: Path):
    book = HolderBook(tmp_path / "gpu")
    me = ProcessIdentity.current()
    first = HolderRecord("gpu", "lease-a", "run-1", "brave-owl", me.host, me.pid, me.started, 100.0)
    second = HolderRecord("gpu", "lease-b", None, None, me.host, me.pid, me.started, 50.0)
    with book.locked():
        book.write(first)
        book.write(second)
    (tmp_path / "gpu" / "lease-c.json").write_text("{not json")
    assert book.records() == [second, first], "oldest first"
    assert not (tmp_path / "gpu" / "lease-c.json").exists()
    assert "flow run brave-owl run-1" in first.describe() and f"pid {me.pid}" in first.describe()
    book.remove("lease-a")
    assert book.records() == [second]


def test_a_waiter_names_the_live_holders_or_says_it_waits_for_another_host():
    me = ProcessIdentity.current()
    holder = HolderRecord("gpu", "lease-a", "run-1", "brave-owl", me.host, me.pid, me.started, 100.0)
    text = waiting_text([holder], 35.4, 300.0)
    assert text.startswith(f"held by flow run brave-owl run-1 (pid {me.pid} on {me.host}), holding it since ")
    assert text.endswith("; waited 35 s so far")
    elsewhere = waiting_text([], 7.0, 300.0)
    assert "a holder not recorded on this host" in elsewhere and "revokes its lease 300 s after" in elsewhere
    assert elsewhere.endswith("waited 7 s so far")
