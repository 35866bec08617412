"""A secret passed to the engine (`server.env`) is a `$VAR` reference in everything written: the config, its
dump (launch configs, Prefect parameters), the kept serve script (pushed to the Hub with the draft). Only the
engine's own environment holds the value, expanded from this process's at its start."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from pydantic import ValidationError

from eagle3_core.config import ConfigError, PipelineConfig, dump_config, load_config
from eagle3_core.release.commands import serve_command
from eagle3_core.serving.engine import ServerError, build_env

SECRET = "hf_not-for-any-file"


@pytest.mark.parametrize("name", ["HF_TOKEN", "OPENAI_API_KEY", "AWS_SECRET_ACCESS_KEY", "DB_PASSWORD"])
def test_a_secret_named_variable_with_its_value_is_refused_without_echoing_it(name, tmp_path):
    file = tmp_path / "run.yaml"
    file.write_text(f"server:\n  env:\n    {name}: {SECRET}\n")
    for source, overrides in ((file, []), (None, [f"server.env.{name}={SECRET}"])):
        with pytest.raises(ConfigError) as refused:
            load_config(source, overrides)
        assert f"server.env: {name}: a secret's value is refused" in str(refused.value)
        assert f"write `{name}: ${name}`" in str(refused.value) and SECRET not in str(refused.value)
    with pytest.raises(ValidationError):
        PipelineConfig.model_validate({"evaluation": {"sglang_env": {name: SECRET}}})


def test_a_reference_is_written_as_a_reference_and_expanded_only_in_the_engines_environment(tmp_path, monkeypatch):
    config = PipelineConfig.model_validate({"server": {"env": {"HF_TOKEN": "$HF_TOKEN", "VLLM_LOGGING_LEVEL": "INFO"}}})
    monkeypatch.setenv("HF_TOKEN", SECRET)
    script = serve_command(config, "vllm", Path("/models/target"), tmp_path, 3, 8000).script("test")
    assert 'HF_TOKEN="$HF_TOKEN"' in script and SECRET not in script and SECRET not in dump_config(config)
    assert build_env(config.server, None)["HF_TOKEN"] == SECRET
    shell = subprocess.run(
        ["sh", "-c", 'env HF_TOKEN="$HF_TOKEN" sh -c \'echo "$HF_TOKEN"\''], capture_output=True, text=True
    )
    assert shell.stdout.strip() == SECRET, "the script's form hands the variable's value to the engine"
    monkeypatch.delenv("HF_TOKEN")
    with pytest.raises(ServerError, match=r"^HF_TOKEN=\$HF_TOKEN: not set in this process's environment"):
        build_env(config.server, None)
