"""Everything a Prefect server needs before the deployments can run: the process work pool `gpu` (one
worker per GPU host: `prefect worker start --pool gpu`) and the global concurrency limit `gpu` (one slot:
one engine owner at a time). Then the deployments of prefect.yaml are registered with `prefect deploy`, each
`config` parameter laid over configs/demo.yaml (the demo budget is written there once: prefect.yaml names only
what differs, each deployment's `run_dir`). Every step is idempotent: running `eagle3 deploy` twice changes
nothing."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.exceptions import ObjectAlreadyExists

from eagle3_core.config import PipelineConfig
from tasks.gpu_slot import ensure_concurrency_limit

REPO = Path(__file__).resolve().parents[1]
PREFECT_FILE = REPO / "prefect.yaml"
DEMO_CONFIG = REPO / "configs" / "demo.yaml"
WORK_POOL = "gpu"
POOL_TYPE = "process"


def ensure_work_pool(name: str = WORK_POOL, pool_type: str = POOL_TYPE) -> str:
    """Create the work pool unless it exists; return its type."""
    with get_client(sync_client=True) as client:
        with contextlib.suppress(ObjectAlreadyExists):
            client.create_work_pool(WorkPoolCreate(name=name, type=pool_type))
        return client.read_work_pool(name).type


def overlaid(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`base` with `over`'s values in place, section by section (a nested key replaces only itself)."""
    merged = dict(base)
    for key, value in over.items():
        both_sections = isinstance(value, dict) and isinstance(base.get(key), dict)
        merged[key] = overlaid(base[key], value) if both_sections else value
    return merged


def rendered_deployments(prefect_file: Path = PREFECT_FILE, demo_config: Path = DEMO_CONFIG) -> dict[str, Any]:
    """prefect.yaml as `prefect deploy` reads it: every deployment's `config` parameter laid over the demo
    config, and checked against PipelineConfig so a bad field fails here, not in a worker."""
    spec = yaml.safe_load(prefect_file.read_text())
    demo = yaml.safe_load(demo_config.read_text())
    for deployment in spec["deployments"]:
        parameters = deployment.get("parameters") or {}
        if "config" in parameters:
            parameters["config"] = overlaid(demo, parameters["config"])
            PipelineConfig.model_validate(parameters["config"])
    return spec


def deploy_all(prefect_file: Path = PREFECT_FILE) -> None:
    """Register every deployment of prefect.yaml, rendered (`rendered_deployments`), from the repo root: the
    workers run the flows there."""
    prefect = str(Path(sys.executable).parent / "prefect")
    with tempfile.TemporaryDirectory() as folder:
        rendered = Path(folder) / "prefect.yaml"
        rendered.write_text(yaml.safe_dump(rendered_deployments(prefect_file), sort_keys=False))
        command = [prefect, "--no-prompt", "deploy", "--all", "--prefect-file", str(rendered)]
        subprocess.run(command, cwd=REPO, env=os.environ.copy(), check=True)


def set_up(gpu_slots: int = 1) -> dict[str, str | int]:
    """Work pool, concurrency limit, deployments; returns what exists afterwards."""
    pool_type = ensure_work_pool()
    limit = ensure_concurrency_limit("gpu", gpu_slots)
    deploy_all()
    return {"work_pool": WORK_POOL, "work_pool_type": pool_type, "gpu_limit": limit}
