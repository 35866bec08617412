"""The server's API key from a Prefect Secret block: the tasks put it where the clients read it, while the
config (and so every dump, manifest and cache key) carries only the block's name."""

from __future__ import annotations

import pytest
import yaml
from prefect.blocks.system import Secret

from eagle3_core.config import SECRET_KEY_VARIABLE, ConfigError, PipelineConfig, dump_config, load_config
from eagle3_core.serving.engine import api_key_of
from tasks.secrets import export_api_key

KEY = "sk-unit-3b9e0f27c1"


@pytest.fixture(scope="module")
def prefect_api(prefect_api):
    """The session's Prefect API, holding the block these tests read."""
    Secret(value=KEY).save("unit-key", overwrite=True)


@pytest.mark.parametrize("variable", [None, "MY_VLLM_KEY"])
def test_the_block_key_reaches_the_client_and_never_the_config(prefect_api, monkeypatch, variable):
    expected_variable = variable or SECRET_KEY_VARIABLE
    monkeypatch.delenv(expected_variable, raising=False)
    config = PipelineConfig(server={"api_key_secret": "unit-key", "api_key_env": variable})
    assert api_key_of(config.server) is None
    export_api_key(config.server)
    assert api_key_of(config.server) == KEY
    assert KEY not in dump_config(config) and KEY not in config.model_dump_json()


def test_a_missing_block_names_the_field(prefect_api):
    config = PipelineConfig(server={"api_key_secret": "no-such-block"})
    with pytest.raises(ValueError, match=r"server\.api_key_secret: no Prefect Secret block 'no-such-block'"):
        export_api_key(config.server)


def test_no_block_no_key(monkeypatch):
    monkeypatch.delenv(SECRET_KEY_VARIABLE, raising=False)
    export_api_key(PipelineConfig().server)
    assert api_key_of(PipelineConfig().server) is None


@pytest.mark.parametrize("args", [["--api-key", KEY], [f"--api-key={KEY}"]])
def test_a_key_in_extra_args_is_refused_without_echoing_it(tmp_path, args):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"server": {"extra_args": args}}))
    with pytest.raises(ConfigError) as error:
        load_config(path)
    assert "server.extra_args" in str(error.value) and "server.api_key_env" in str(error.value)
    assert KEY not in str(error.value)


@pytest.mark.parametrize(
    "override", [f"server.extra_args=[--api-key, {KEY}]", f"server.extra_args=[--api-key={KEY}]", f"x=[--api-key {KEY}"]
)
def test_an_override_carrying_a_key_is_refused_without_echoing_it(override):
    """The error quotes the override (so the user sees which one failed), with the key itself redacted."""
    with pytest.raises(ConfigError) as error:
        load_config(None, [override])
    assert "--api-key" in str(error.value) and "<redacted>" in str(error.value)
    assert KEY not in str(error.value)
