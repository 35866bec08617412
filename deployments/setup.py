"""Everything a Prefect server needs before the deployments can run: the process work pool `gpu` (one
worker per GPU host: `prefect worker start --pool gpu`) and the global concurrency limit `gpu` (one slot:
one engine owner at a time). Then the deployments of prefect.yaml are registered with `prefect deploy`.
Every step is idempotent: running `eagle3 deploy` twice changes nothing."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.exceptions import ObjectAlreadyExists

from tasks.gpu_slot import ensure_concurrency_limit

REPO = Path(__file__).resolve().parents[1]
WORK_POOL = "gpu"
POOL_TYPE = "process"


def ensure_work_pool(name: str = WORK_POOL, pool_type: str = POOL_TYPE) -> str:
    """Create the work pool unless it exists; return its type."""
    with get_client(sync_client=True) as client:
        with contextlib.suppress(ObjectAlreadyExists):
            client.create_work_pool(WorkPoolCreate(name=name, type=pool_type))
        return client.read_work_pool(name).type


def deploy_all(prefect_file: Path = REPO / "prefect.yaml") -> None:
    """Register every deployment of prefect.yaml (run from the repo root: the workers run the flows there)."""
    prefect = str(Path(sys.executable).parent / "prefect")
    command = [prefect, "--no-prompt", "deploy", "--all", "--prefect-file", str(prefect_file)]
    subprocess.run(command, cwd=REPO, env=os.environ.copy(), check=True)


def set_up(gpu_slots: int = 1) -> dict[str, str | int]:
    """Work pool, concurrency limit, deployments; returns what exists afterwards."""
    pool_type = ensure_work_pool()
    limit = ensure_concurrency_limit("gpu", gpu_slots)
    deploy_all()
    return {"work_pool": WORK_POOL, "work_pool_type": pool_type, "gpu_limit": limit}
