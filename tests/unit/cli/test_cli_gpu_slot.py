"""A phase command holds the `gpu` slot as the flow's task does, where there is a slot to share (a Prefect
server, or a host with GPUs): its holder record is on the book while it runs and gone after; on a CPU host
without a Prefect server it starts no Prefect at all."""

from __future__ import annotations

from contextlib import ExitStack
from uuid import uuid4

import pytest
from prefect.settings import PREFECT_API_URL, temporary_settings

from cli.holds import HELD, hold_gpu_slot
from eagle3_core.config import PipelineConfig
from eagle3_core.events import RunEvents
from tasks.gpu_slot.leases import holder_book


def test_a_phase_command_holds_the_gpu_slot_of_the_prefect_server_until_it_ends(prefect_api, tmp_path):
    limit = f"gpu-{uuid4().hex[:8]}"
    config = PipelineConfig(run_dir=tmp_path / "run", orchestration={"gpu_limit": limit})
    with ExitStack() as held:
        HELD.set(held)
        hold_gpu_slot(config, RunEvents(config.run_dir), "sampling")
        [record] = holder_book(limit).records()
        assert record.process.is_self_or_ancestor()
    assert holder_book(limit).records() == []


def test_a_cpu_host_without_a_prefect_server_holds_no_slot(tmp_path, monkeypatch):
    monkeypatch.setattr("eagle3_core.preflight.visible_gpus", lambda: 0)
    monkeypatch.setattr("flows.temporary_server.own_temporary_server", pytest.fail)
    monkeypatch.setattr("tasks.gpu_slot.gpu_slot", pytest.fail)
    config = PipelineConfig(run_dir=tmp_path / "run")
    with temporary_settings({PREFECT_API_URL: None}), ExitStack() as held:
        HELD.set(held)
        hold_gpu_slot(config, RunEvents(config.run_dir), "sampling")
