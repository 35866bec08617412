"""A holder of the `gpu` slot killed outright (SIGKILL) never blocks the next run, and a live one is never
robbed (`tasks.gpu_slot`): real processes, real SIGKILLs, a real Prefect API (a server that outlives the
holders, like a `prefect server start`) and real ephemeral servers (PREFECT_HOME of the test, no
PREFECT_API_URL, the default of `eagle3 run`), whose killed run leaves no temporary server behind."""

from __future__ import annotations

import contextvars
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from uuid import uuid4

import psutil
import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import GlobalConcurrencyLimitUpdate
from prefect.exceptions import ObjectNotFound
from prefect.settings import PREFECT_API_URL, PREFECT_HOME, temporary_settings

from eagle3_core.events import RunEvents
from eagle3_core.progress import ProgressUpdate
from flows.temporary_server import APP, records_dir
from tasks.gpu_slot import HolderRecord, ProcessIdentity, death_of, ensure_concurrency_limit, gpu_slot
from tests.helpers.processes import dead_pid, decisions

RUN_IDS = {name: uuid4() for name in ("ended", "running", "missing")}

REPO = Path(__file__).resolve().parents[4]

# Holds `limit` for `seconds`, inside a flow run; prints "held" once it has the slot. Without
# PREFECT_API_URL it first starts its temporary server the way `eagle3 run` does.
HOLDER = textwrap.dedent(
    """
    import sys, time
    from prefect import flow
    from eagle3_core.events import RunEvents
    from flows.temporary_server import own_temporary_server
    from tasks.gpu_slot import gpu_slot

    limit, run_dir, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
    own_temporary_server(RunEvents(run_dir))

    @flow
    def hold() -> None:
        with gpu_slot(limit, RunEvents(run_dir), phase="holder"):
            print("held", flush=True)
            time.sleep(seconds)

    hold()
    print("done", flush=True)
    """
)


def start_holder(tmp_path: Path, limit: str, seconds: float, env: dict[str, str], name: str) -> subprocess.Popen:
    script = tmp_path / "holder.py"
    script.write_text(HOLDER)
    out = open(tmp_path / f"{name}.out", "w")  # noqa: SIM115 (closed with the process)
    return subprocess.Popen(
        [sys.executable, str(script), limit, str(tmp_path / name), str(seconds)],
        env={**env, "PYTHONPATH": str(REPO)},
        stdout=out,
        stderr=subprocess.STDOUT,
        text=True,
    )


def wait_output(tmp_path: Path, name: str, text: str, proc: subprocess.Popen, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    log = tmp_path / f"{name}.out"
    while text not in log.read_text():
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, f"no {text!r} from {name}: {log.read_text()}"
        time.sleep(0.5)


def active_slots(limit: str) -> int:
    with get_client(sync_client=True) as client:
        return client.read_global_concurrency_limit_by_name(limit).active_slots


def set_active_slots(limit: str, slots: int) -> None:
    with get_client(sync_client=True) as client:
        client.update_global_concurrency_limit(limit, GlobalConcurrencyLimitUpdate(active_slots=slots))


# --- telling a dead holder ------------------------------------------------------------------------------


def test_a_holder_of_another_host_is_dead_once_its_flow_run_has_ended():
    me = ProcessIdentity.current()
    states = {
        "ended": SimpleNamespace(name="Crashed", is_final=lambda: True),
        "running": SimpleNamespace(name="Running", is_final=lambda: False),
    }

    def read_flow_run(flow_run_id):
        if flow_run_id == RUN_IDS["missing"]:
            raise ObjectNotFound(http_exc=Exception())
        return SimpleNamespace(state=states[next(k for k, v in RUN_IDS.items() if v == flow_run_id)])

    client = SimpleNamespace(read_flow_run=read_flow_run)

    def holder(run: str | None, host: str = "another-host", pid: int = me.pid) -> HolderRecord:
        flow_run_id = str(RUN_IDS[run]) if run else None
        return HolderRecord("gpu", "lease", flow_run_id, None, host, pid, me.started, 0.0)

    assert death_of(client, holder("ended")) == "that flow run ended (Crashed)"
    assert death_of(client, holder("running")) is None
    assert death_of(client, holder("missing")) is None, "unknown counts as alive"
    assert death_of(client, holder(None)) is None
    assert death_of(client, holder("running", host=me.host, pid=dead_pid())) == "that process is gone"


# --- on a Prefect server that outlives the holders (PREFECT_API_URL) -------------------------------------


def holding(tmp_path: Path, limit: str, seconds: float, name: str) -> subprocess.Popen:
    """A holder process of `limit` on this test's Prefect server, once it has the slot."""
    ensure_concurrency_limit(limit)
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}
    holder = start_holder(tmp_path, limit, seconds, env, name)
    try:
        wait_output(tmp_path, name, "held", holder)
    except BaseException:
        holder.kill()
        raise
    return holder


@pytest.mark.timeout(600)
def test_the_slot_of_a_killed_holder_is_given_back_at_once(prefect_api, tmp_path: Path):
    limit = "gpu-killed"
    holder = holding(tmp_path, limit, 600, "killed")
    holder.kill()
    holder.wait()
    assert active_slots(limit) == 1, "the killed holder's slot is still taken"
    run_dir = tmp_path / "next"
    start = time.monotonic()
    updates: list[ProgressUpdate] = []
    with gpu_slot(limit, RunEvents(run_dir), progress=updates.append, phase="training"):
        waited = time.monotonic() - start
        assert active_slots(limit) == 1
    assert waited < 10, "no wait beyond the check"
    assert updates == []
    [decision] = decisions(run_dir)
    assert decision["phase"] == "training" and decision["holder_pid"] == holder.pid
    assert f"pid {holder.pid}" in decision["message"] and "process is gone" in decision["message"]
    assert active_slots(limit) == 0


@pytest.mark.timeout(600)
def test_a_live_holder_is_waited_for_and_the_wait_is_reported(prefect_api, tmp_path: Path):
    limit = "gpu-live"
    holder = holding(tmp_path, limit, 12, "live")
    try:
        start = time.monotonic()
        updates: list[ProgressUpdate] = []
        with gpu_slot(limit, RunEvents(tmp_path / "waiter"), progress=updates.append, phase="sampling"):
            waited = time.monotonic() - start
    finally:
        holder.wait(timeout=120)
    assert holder.returncode == 0
    assert waited >= 8, "the live holder kept its slot to the end"
    assert len(updates) >= 2, "a progress line every few seconds"
    assert all(u.phase == "sampling" and u.stage == f"waiting for the {limit} slot" for u in updates)
    assert f"pid {holder.pid}" in updates[0].message and "holding it since" in updates[0].message
    assert updates[-1].done >= 5 and "waited" in updates[-1].message
    assert decisions(tmp_path / "waiter") == [], "a live holder is never robbed"


@pytest.mark.timeout(300)
def test_a_slot_without_a_holder_on_record_is_left_to_the_servers_lease_expiry(prefect_api, tmp_path: Path):
    """On a Prefect server, holders of other hosts are not on record here: their slots are never counted
    as dead (the server's repossessor revokes an expired lease)."""
    limit = "gpu-unrecorded"
    ensure_concurrency_limit(limit)
    set_active_slots(limit, 1)
    updates: list[ProgressUpdate] = []
    taken = threading.Event()

    def take() -> None:
        with gpu_slot(limit, RunEvents(tmp_path / "run"), progress=updates.append, phase="evaluation"):
            taken.set()

    worker = threading.Thread(target=contextvars.copy_context().run, args=(take,))  # this test's Prefect API
    worker.start()
    assert not taken.wait(8)
    assert updates and "not recorded on this host" in updates[0].message
    set_active_slots(limit, 0)  # what the repossessor does when the lease expires
    assert taken.wait(30)
    worker.join()
    assert decisions(tmp_path / "run") == []


# --- the default: an ephemeral API per run (no PREFECT_API_URL) ----------------------------------------


def ephemeral_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    return {**env, "PREFECT_HOME": str(home), "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "240"}


def servers_of(home: Path) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter():
        try:
            if APP in " ".join(process.cmdline()) and process.environ().get("PREFECT_HOME") == str(home):
                found.append(process)
        except psutil.Error:
            continue
    return found


@pytest.mark.timeout(900)
def test_a_killed_run_leaves_no_temporary_server_and_the_next_run_takes_its_slot(tmp_path: Path):
    home = tmp_path / "prefect-home"
    env = ephemeral_env(home)
    holder = start_holder(tmp_path, "gpu", 600, env, "killed")
    try:
        wait_output(tmp_path, "killed", "held", holder)
        [server] = servers_of(home)
    finally:
        holder.kill()
        holder.wait()
    server.wait(timeout=30)  # the parent-death signal stopped it
    assert servers_of(home) == []

    nxt = start_holder(tmp_path, "gpu", 0, env, "next")
    assert nxt.wait(timeout=600) == 0, (tmp_path / "next.out").read_text()
    [decision] = decisions(tmp_path / "next")
    assert decision["holder_pid"] == holder.pid and "died with its temporary Prefect server" in decision["message"]
    assert servers_of(home) == [], "the next run's server stopped at its exit"
    assert list(records_dir_of(home).glob("*.json")) == []


def records_dir_of(home: Path) -> Path:
    with temporary_settings({PREFECT_HOME: str(home)}):
        return records_dir()
