"""The fan-out over hosts (tasks/hosts.py, flows/host_phase.py) without a worker: each child run's parameters
are JSON that the `host-phase` flow validates into its slice's config and the upstream manifests; the child
holds its own host's GPU slot and writes its slice's folder, and run again it resumes there; child runs that
did not complete fail the parent's task by name."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from uuid import uuid4

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import FlowRun
from prefect.states import Completed, Crashed
from prefect.utilities.callables import parameter_schema
from prefect.utilities.schema_tools import validate

from eagle3_core.config import PipelineConfig
from eagle3_core.events import CACHE_HIT, RunEvents
from eagle3_core.run_layout import RunLayout
from flows.host_phase import host_phase
from tasks import hosts
from tasks.hosts import DEPLOYMENT, HostsFailed, child_parameters, host_gpu_limit, run_on_hosts
from tests.helpers.extraction_fixtures import build_sample_set

SCHEMA = parameter_schema(host_phase).model_dump_for_openapi()


def test_each_child_gets_its_slice_and_the_upstream_manifests(tmp_path: Path, smollm2_target):
    config = PipelineConfig(run_dir=tmp_path, orchestration={"hosts": 3})
    for host in range(3):
        parameters = child_parameters(config, "sampling", host, {"target": smollm2_target})
        validate(parameters, SCHEMA, raise_on_error=True)  # as the server does when it creates the run
        validated = host_phase.validate_parameters(json.loads(json.dumps(parameters)))
        child = validated["config"]
        assert (child.orchestration.host, child.orchestration.hosts, validated["phase"]) == (host, 3, "sampling")
        assert child.model_copy(update={"orchestration": config.orchestration}) == config
        assert RunLayout.of(child).samples == tmp_path / "samples" / f"host-{host}-of-3"
        assert validated["target"].digest == smollm2_target.digest
    assert config.orchestration.host is None


def test_a_child_holds_the_gpu_slot_of_its_own_host():
    config = host_gpu_limit(PipelineConfig())
    assert config.orchestration.gpu_limit == f"gpu-{socket.gethostname()}"


def test_child_runs_that_did_not_complete_are_named(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    started = []

    def run_deployment(name, parameters, flow_run_name, timeout):
        started.append((name, parameters["config"]["orchestration"]["host"], flow_run_name, timeout))
        return FlowRun(flow_id=uuid4(), name=flow_run_name)

    def wait_for_all(runs):
        states = [Completed(), Crashed(message="worker on gpu-b lost")]
        return [run.model_copy(update={"state": state}) for run, state in zip(runs, states, strict=True)]

    monkeypatch.setattr(hosts, "run_deployment", run_deployment)
    monkeypatch.setattr(hosts, "wait_for_all", wait_for_all)
    config = PipelineConfig(run_dir=tmp_path, orchestration={"hosts": 2})
    with pytest.raises(
        HostsFailed, match=r"1 of 2 extraction child runs did not complete: host 1: .*worker on gpu-b lost"
    ):
        run_on_hosts(config, "extraction")
    assert started == [
        (DEPLOYMENT, 0, "extraction-host-0-of-2", 0),
        (DEPLOYMENT, 1, "extraction-host-1-of-2", 0),
    ]


def test_a_child_run_extracts_its_slice_holding_its_hosts_slot_and_resumes_there(
    prefect_api, tmp_path: Path, smollm2_target, tiny_llama
):
    samples = build_sample_set(tmp_path / "samples", smollm2_target.root_path, num_ok=6)
    config = PipelineConfig(run_dir=tmp_path / "run", extraction={"backend": "hf"}, orchestration={"hosts": 2})
    parameters = child_parameters(config, "extraction", 1, {"sample_set": samples, "target": tiny_llama})
    sliced = host_phase(**host_phase.validate_parameters(parameters))
    assert sliced.root == str((tmp_path / "run" / "hidden_states" / "host-1-of-2").resolve())
    assert 0 < sliced.samples < 6
    with get_client(sync_client=True) as client:
        assert client.read_global_concurrency_limit_by_name(f"gpu-{socket.gethostname()}").limit == 1
    again = host_phase(**host_phase.validate_parameters(parameters))
    assert again.digest == sliced.digest and RunEvents(config.run_dir).count(CACHE_HIT) == 1
