"""The deployments' `config` parameter is configs/demo.yaml, the one place the demo budget is written:
`eagle3 deploy` lays each deployment's few keys of prefect.yaml over it (deployments/setup.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from deployments.setup import DEMO_CONFIG, PREFECT_FILE, overlaid, rendered_deployments
from eagle3_core.config import ConfigError, PipelineConfig

CONFIGURED = ("train-drafter", "nightly-regenerate")


def deployment_configs(spec: dict) -> dict[str, dict]:
    return {d["name"]: d["parameters"]["config"] for d in spec["deployments"] if "config" in d.get("parameters", {})}


def test_each_deployment_runs_the_demo_budget_in_its_own_run_dir():
    demo = yaml.safe_load(DEMO_CONFIG.read_text())
    configs = deployment_configs(rendered_deployments())
    assert set(configs) == set(CONFIGURED)
    for name, config in configs.items():
        assert {**config, "run_dir": demo["run_dir"]} == demo, name
    assert len({config["run_dir"] for config in configs.values()} | {demo["run_dir"]}) == 3


def test_prefect_yaml_holds_no_copy_of_the_budget():
    """Only what differs from configs/demo.yaml may be written in prefect.yaml: the run directory."""
    for name, config in deployment_configs(yaml.safe_load(PREFECT_FILE.read_text())).items():
        assert set(config) == {"run_dir"}, f"{name} in prefect.yaml repeats {sorted(set(config) - {'run_dir'})}"


def test_a_nested_key_replaces_only_itself():
    base = {"run_dir": "a", "sampling": {"max_tokens": 128, "max_prompts": 4}}
    assert overlaid(base, {"sampling": {"max_tokens": 160}}) == {
        "run_dir": "a",
        "sampling": {"max_tokens": 160, "max_prompts": 4},
    }


def test_a_bad_field_in_prefect_yaml_fails_at_deploy(tmp_path: Path):
    spec = yaml.safe_load(PREFECT_FILE.read_text())
    spec["deployments"][0]["parameters"]["config"]["sampling"] = {"max_tokenz": 1}
    bad = tmp_path / "prefect.yaml"
    bad.write_text(yaml.safe_dump(spec))
    with pytest.raises((ValueError, ConfigError), match="max_tokenz"):
        rendered_deployments(bad)
    assert PipelineConfig.model_validate(deployment_configs(rendered_deployments())["train-drafter"])
