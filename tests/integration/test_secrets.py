"""Secrets and exposure: a planted API key, given to vLLM from the environment and to the sampling task from a
Prefect Secret block, is sent by the client (the server refuses requests without it) and written nowhere:
not in the run directory (events.jsonl, manifests, server log, pid file, task results) nor in Prefect's
logs, artifacts, flow and task runs. The started server listens on loopback only."""

from __future__ import annotations

import json
import os

import httpx
import psutil
import pytest
from prefect import flow
from prefect.blocks.system import Secret
from prefect.client.orchestration import get_client
from prefect.logging.handlers import APILogWorker
from prefect.testing.utilities import prefect_test_harness

from eagle3_core.artifacts import SampleSet, TargetModel
from eagle3_core.config import SECRET_KEY_VARIABLE, PipelineConfig, ServerConfig
from eagle3_core.events import RunEvents
from eagle3_core.serving.engine import VllmServer
from tasks.policy import configured
from tasks.sampling import PHASE, sample_prompts_task

pytestmark = pytest.mark.slow

PLANTED = "sk-planted-7f3a9c41d2e8b605"
BLOCK = "eagle3-planted-key"
SERVER_KEY_VARIABLE = "EAGLE3_TEST_SERVER_KEY"


@flow
def sample_only(config: PipelineConfig, target: TargetModel) -> SampleSet:
    return configured(sample_prompts_task, config, PHASE)(config, target)


def listening_addresses(port: int) -> set[str]:
    return {
        c.laddr.ip
        for c in psutil.net_connections("inet")
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
    }


def prefect_records() -> tuple[str, int, int]:
    """Every log, artifact, flow run and task run the Prefect API holds, as one text; and the counts of
    logs and artifacts (so the grep is known to have looked at something)."""
    APILogWorker.drain_all(timeout=30)
    with get_client(sync_client=True) as client:
        logs = client.read_logs()
        artifacts = client.read_artifacts()
        runs = client.read_flow_runs() + client.read_task_runs()
    records = [r.model_dump(mode="json") for r in [*logs, *artifacts, *runs]]
    return json.dumps(records), len(logs), len(artifacts)


def test_a_planted_key_is_sent_and_never_written(tmp_path, smollm2_target, monkeypatch):
    run_dir = tmp_path / "run"
    monkeypatch.setenv(SERVER_KEY_VARIABLE, PLANTED)
    server_config = ServerConfig(api_key_env=SERVER_KEY_VARIABLE, stall_timeout_s=300, startup_timeout_s=600)
    try:
        with (
            prefect_test_harness(server_startup_timeout=120),
            VllmServer(server_config, smollm2_target.root, run_dir, RunEvents(run_dir)) as server,
        ):
            monkeypatch.delenv(SERVER_KEY_VARIABLE)
            assert listening_addresses(server.port) == {"127.0.0.1"}
            assert httpx.get(f"{server.base_url}/v1/models", timeout=30).status_code == 401
            authorised = {"Authorization": f"Bearer {PLANTED}"}
            assert httpx.get(f"{server.base_url}/v1/models", headers=authorised, timeout=30).status_code == 200

            Secret(value=PLANTED).save(BLOCK, overwrite=True)
            config = PipelineConfig(
                run_dir=run_dir,
                server={"engine": "external", "url": server.base_url, "api_key_secret": BLOCK},
                sampling={"max_prompts": 4, "max_tokens": 8, "concurrency": 4},
            )
            assert PLANTED not in config.model_dump_json()
            sample_set = sample_only(config, smollm2_target)
            assert (sample_set.ok, sample_set.error) == (4, 0), sample_set.errors
            prefect_text, logs, artifacts = prefect_records()
    finally:
        os.environ.pop(SECRET_KEY_VARIABLE, None)

    written = [p for p in run_dir.rglob("*") if p.is_file()]
    assert {"events.jsonl", "sample_set.json"} <= {p.name for p in written}
    assert any(p.suffix == ".log" and p.parent.name == "server" for p in written)
    assert [str(p) for p in written if PLANTED.encode() in p.read_bytes()] == []
    assert logs > 0 and artifacts > 0
    assert PLANTED not in prefect_text
