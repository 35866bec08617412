"""Fan-out of a phase over `orchestration.hosts` hosts with Prefect's own machinery: one child flow run per
host of the `host-phase` deployment (`flows/host_phase.py`) on the `gpu` work pool, started with
`run_deployment` and awaited by reading their states from the API. Each child works on its slice
(`orchestration.host`, `eagle3_core.hosts`) in the shared run directory; the parent's task merges what they
left. Which worker, and so which host, runs a child is the pool's business: a lost host's slice is run again
by whichever worker takes it on the parent task's retry, resuming from the shards it had written."""

from __future__ import annotations

import socket
import time
from typing import Any

from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import FlowRun
from prefect.deployments import run_deployment

from eagle3_core.artifacts import Manifest
from eagle3_core.config import PipelineConfig
from eagle3_core.hosts import every_slice

DEPLOYMENT = "host-phase/host-phase"  # flow name / deployment name (prefect.yaml)
POLL_S = 5.0


class HostsFailed(RuntimeError):
    """A child flow run of a fan-out did not complete; the message names each, its host and its state."""


def on_host(config: PipelineConfig, host: int) -> PipelineConfig:
    """`config` for the child run of slice `host`."""
    return config.model_copy(update={"orchestration": config.orchestration.model_copy(update={"host": host})})


def child_parameters(config: PipelineConfig, phase: str, host: int, upstream: dict[str, Manifest]) -> dict[str, Any]:
    """The `host-phase` parameters of slice `host`: JSON (the child validates them into its typed ones)."""
    return {
        "config": on_host(config, host).model_dump(mode="json"),
        "phase": phase,
        **{name: manifest.model_dump(mode="json", exclude={"digest"}) for name, manifest in upstream.items()},
    }


def host_gpu_limit(config: PipelineConfig) -> PipelineConfig:
    """`config` holding this host's GPU slot, `<gpu_limit>-<hostname>`: one engine owner per host, whichever
    slices the pool gives it (the global `gpu` slot would let one host work at a time)."""
    orchestration = config.orchestration
    limit = f"{orchestration.gpu_limit}-{socket.gethostname()}"
    return config.model_copy(update={"orchestration": orchestration.model_copy(update={"gpu_limit": limit})})


def wait_for_all(runs: list[FlowRun], poll_s: float = POLL_S) -> list[FlowRun]:
    """The runs as the API has them once every one is final, read every `poll_s` seconds (the API's event
    stream, which `wait_for_flow_run` follows, lost a child's final state on a loaded server)."""
    with get_client(sync_client=True) as client:
        while True:
            current = [client.read_flow_run(run.id) for run in runs]
            if all(run.state is not None and run.state.is_final() for run in current):
                return current
            time.sleep(poll_s)


def run_on_hosts(config: PipelineConfig, phase: str, **upstream: Manifest) -> None:
    """Run `phase` as one child flow run per host (all at once) and wait for every one; `HostsFailed`
    naming those that did not complete."""
    hosts = config.orchestration.hosts
    runs = [
        run_deployment(
            DEPLOYMENT,
            parameters=child_parameters(config, phase, part.host, upstream),
            flow_run_name=f"{phase}-{part.name}",
            timeout=0,
        )
        for part in every_slice(hosts)
    ]
    finished = wait_for_all(runs)
    failed = [
        f"host {host}: {run.name} {run.state!r}"
        for host, run in enumerate(finished)
        if run.state is None or not run.state.is_completed()
    ]
    if failed:
        raise HostsFailed(f"{len(failed)} of {hosts} {phase} child runs did not complete: " + "; ".join(failed))
