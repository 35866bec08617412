"""The train-drafter flow posts the run's plan as a markdown artifact before its first phase: a real flow
run on the session's Prefect test server, stopped by a config mistake right after prepare_target (layer
ids past the target's depth, refused before sampling), so no engine starts."""

from __future__ import annotations

import shutil

import pytest
from prefect.client.orchestration import get_client

from eagle3_core.config import ConfigError, PipelineConfig
from eagle3_core.events import DECISION, RunEvents
from flows.train_drafter import train_drafter
from tests.helpers.devices import TARGET_CONFIGS


def test_the_plan_is_posted_before_the_first_phase(prefect_api, tmp_path):
    target = tmp_path / "llama-3.1-8b-instruct"
    shutil.copytree(TARGET_CONFIGS / "llama-3.1-8b-instruct", target)  # config.json only: no weights to load
    config = PipelineConfig.model_validate(
        {
            "run_dir": str(tmp_path / "run"),
            "target": {"model": str(target)},
            "extraction": {"layer_ids": [2, 16, 40]},  # the target has 32 layers
            "orchestration": {"retries": 0},
        }
    )
    with pytest.raises(ConfigError, match=r"extraction\.layer_ids"):
        train_drafter(config)
    heading = f"# Plan of {tmp_path / 'run'}\n"  # this run's: other tests post plans to the same server
    with get_client(sync_client=True) as client:
        plans = [a for a in client.read_artifacts() if a.key == "train-drafter-plan" and a.data.startswith(heading)]
    assert len(plans) == 1 and plans[0].type == "markdown"
    text = plans[0].data
    assert "- costs: 8.03B parameters, 16.1 GB of weights (config.json: 8.03B parameters (bfloat16))" in text
    assert "## sampling: runs" in text
    decisions = [e["message"] for e in RunEvents(tmp_path / "run").read() if e["event"] == DECISION]
    assert any(line.startswith("server on ") for line in decisions), decisions
