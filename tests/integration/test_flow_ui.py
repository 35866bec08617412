"""The Prefect UI end to end: `prefect server start`, `eagle3 deploy`, a process worker on pool `gpu`, and
headless Chromium (playwright-core) opening the train-drafter deployment's custom-run form, changing one
field of the PipelineConfig form and submitting; the run completes through the worker and a screenshot of
it is saved. Also checks the nightly deployment's schedule through the API.

The server (the session's `postgres_prefect_server`, which the two-host test shares) runs on PostgreSQL, as
Prefect recommends for a server that workers share: on SQLite the worker's polls made the server refuse the
UI's write ("database is locked": no run was created) in 2 of 3 CI runs.

Needs Chromium (`apt-get install -y chromium`), playwright-core (`npm install playwright-core`; point
EAGLE3_PLAYWRIGHT_DIR at the folder holding its node_modules) and a PostgreSQL role that may create
databases (EAGLE3_TEST_POSTGRES, a libpq URL of its `postgres` database; `.ci/run` starts Debian's
postgresql and sets it); skipped without them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from eagle3_core.artifacts import TargetModel
from eagle3_core.config import PipelineConfig
from tests.helpers.postgres import PrefectServer
from tests.helpers.processes import start_worker, stop_workers
from tests.helpers.served_targets import pinned_dtypes

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
PLAYWRIGHT_DIR = Path(os.environ.get("EAGLE3_PLAYWRIGHT_DIR", "/tmp/orch/ui"))
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
SCREENSHOTS = Path(os.environ.get("EAGLE3_UI_SCREENSHOTS", REPO / "runs" / "ui-test"))

SUBMIT_JS = """
const { chromium } = require('playwright-core');
(async () => {
  const [base, deploymentId, label, value, shot] = process.argv.slice(2);
  const browser = await chromium.launch({ executablePath: process.env.CHROMIUM, args: ['--no-sandbox'] });
  const page = await browser.newPage({ viewport: { width: 1400, height: 1000 } });
  await page.goto(`${base}/deployments/deployment/${deploymentId}/run`, { waitUntil: 'networkidle' });
  const name = page.locator('.schema-form-property__label', { hasText: label });
  await name.first().waitFor();
  // Sections are properties too: the innermost property holding the label is the field itself.
  const field = page.locator('.schema-form-property', { has: name }).last().locator('input').first();
  await field.fill(value);
  await page.screenshot({ path: shot.replace('.png', '-form.png') });
  await page.getByRole('button', { name: 'Submit' }).click();
  await page.waitForURL(/tab=Runs/, { timeout: 30000 });
  await browser.close();
})();
"""

SHOOT_JS = """
const { chromium } = require('playwright-core');
(async () => {
  const [url, shot] = process.argv.slice(2);
  const browser = await chromium.launch({ executablePath: process.env.CHROMIUM, args: ['--no-sandbox'] });
  const page = await browser.newPage({ viewport: { width: 1400, height: 1000 } });
  await page.goto(url, { waitUntil: 'networkidle' });
  await page.waitForSelector('text=Completed');
  await page.screenshot({ path: shot, fullPage: true });
  await browser.close();
})();
"""

# Tiny budget: the custom run must finish in minutes on 2 shared cores; sampling and extraction on one
# shared server (one engine start), serving the tiny random Llama (its folder as `target.model`): what is
# checked is the form, the worker and the run's end, not the target.
TINY = pinned_dtypes({
    "sampling": {"max_prompts": 6, "max_tokens": 24, "holdout_fraction": 0.34, "concurrency": 4},
    "extraction": {"samples_per_shard": 4, "reuse_sampling_server": "on"},
    "vocab": {"draft_vocab_size": 1024},
    "training": {"epochs": 1, "max_steps": 2, "max_length": 256},
    "evaluation": {"prompt_sets": ["holdout"], "max_prompts": 1, "max_new_tokens": 8, "with_vllm": False,
                   "acceptance_floor": 0.0},
})  # fmt: skip


@pytest.fixture(scope="module")
def prefect_server(request: pytest.FixtureRequest) -> PrefectServer:
    """The session's Prefect server on PostgreSQL (`tests/conftest.py`), which the two-host test's workers
    share when both modules run on one xdist worker."""
    if not CHROMIUM or not (PLAYWRIGHT_DIR / "node_modules" / "playwright-core").is_dir():
        pytest.skip("needs chromium and playwright-core (see the module docstring)")
    return request.getfixturevalue("postgres_prefect_server")


def api_post(base: str, path: str, body: dict) -> list[dict]:
    return httpx.post(f"{base}/api{path}", json=body, timeout=30).json()


def test_custom_run_from_the_ui_completes(prefect_server: PrefectServer, tiny_llama_vllm: TargetModel, tmp_path: Path):
    base, env = prefect_server.base, prefect_server.env
    subprocess.run([sys.executable, "-m", "cli", "deploy"], cwd=REPO, env=env, check=True)
    deployments = {d["name"]: d for d in api_post(base, "/deployments/filter", {})}
    nightly = deployments["nightly-regenerate"]
    assert [s["schedule"]["cron"] for s in nightly["schedules"]] == ["0 2 * * *"]
    assert nightly["work_pool_name"] == deployments["train-drafter"]["work_pool_name"] == "gpu"
    nightly_runs = {"deployments": {"id": {"any_": [nightly["id"]]}}}
    deadline = time.monotonic() + 120
    while not (scheduled := api_post(base, "/flow_runs/filter", nightly_runs)) and time.monotonic() < deadline:
        time.sleep(2)
    assert scheduled and all(r["expected_start_time"][11:16] == "02:00" for r in scheduled), "scheduler made no runs"

    deployment = deployments["train-drafter"]
    run = {**TINY, "run_dir": str(tmp_path / "run"), "target": {"model": str(tiny_llama_vllm.root_path)}}
    tiny = PipelineConfig.model_validate(run).model_dump(mode="json")
    httpx.patch(f"{base}/api/deployments/{deployment['id']}", json={"parameters": {"config": tiny}}).raise_for_status()

    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    shot = SCREENSHOTS / "train-drafter-custom-run.png"
    node_env = {**env, "NODE_PATH": str(PLAYWRIGHT_DIR / "node_modules"), "CHROMIUM": CHROMIUM}
    (tmp_path / "submit.js").write_text(SUBMIT_JS)
    args = [base, deployment["id"], "Max New Tokens (Optional)", "6", str(shot)]
    this_deployment = {"deployments": {"id": {"any_": [deployment["id"]]}}}
    submitted = subprocess.run(["node", str(tmp_path / "submit.js"), *args], env=node_env, timeout=180)
    assert submitted.returncode == 0, "the UI's custom-run form did not submit"
    worker = start_worker(env)
    try:
        runs = api_post(base, "/flow_runs/filter", this_deployment)
        assert len(runs) == 1 and runs[0]["parameters"]["config"]["evaluation"]["max_new_tokens"] == 6
        run_id = runs[0]["id"]
        deadline = time.monotonic() + 1500
        state = runs[0]["state"]["type"]
        while state not in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED") and time.monotonic() < deadline:
            time.sleep(1)
            state = httpx.get(f"{base}/api/flow_runs/{run_id}", timeout=30).json()["state"]["type"]
        assert state == "COMPLETED"
        (tmp_path / "shoot.js").write_text(SHOOT_JS)
        url = f"{base}/runs/flow-run/{run_id}"
        subprocess.run(["node", str(tmp_path / "shoot.js"), url, str(shot)], env=node_env, check=True, timeout=180)
        assert shot.stat().st_size > 10_000
    finally:
        stop_workers([worker])
