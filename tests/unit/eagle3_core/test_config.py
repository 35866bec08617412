from pathlib import Path

import pytest

from eagle3_core.config import ConfigError, PipelineConfig, Section, dump_config, load_config

REPO = Path(__file__).resolve().parents[3]


def test_every_field_has_a_description():
    seen = []

    def walk(model_cls, prefix=""):
        for name, field in model_cls.model_fields.items():
            assert field.description, f"{prefix}{name} has no description"
            seen.append(prefix + name)
            annotation = field.annotation
            if isinstance(annotation, type) and issubclass(annotation, Section):
                walk(annotation, f"{prefix}{name}.")

    walk(PipelineConfig)
    assert "training.lr" in seen and "extraction.layer_ids" in seen


def test_yaml_then_override(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("training:\n  lr: 1.0e-3\n  ttt_steps: 5\n")
    cfg = load_config(path, ["training.lr=3e-4", "sampling.prompt_files=[a.jsonl, b.jsonl]"])
    assert cfg.training.lr == pytest.approx(3e-4)
    assert cfg.training.ttt_steps == 5
    assert cfg.sampling.prompt_files == ["a.jsonl", "b.jsonl"]


def test_unknown_field_names_its_path_and_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("training:\n  learning_rate: 0.1\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert "training.learning_rate" in str(err.value)
    assert str(path) in str(err.value)
    assert "unknown field" in str(err.value)


def test_invalid_override_names_its_path():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["training.lr=-1"])
    assert "training.lr" in str(err.value)
    assert "--set training.lr=-1" in str(err.value)


def test_malformed_override_and_yaml(tmp_path):
    with pytest.raises(ConfigError, match=r"section\.field=value"):
        load_config(None, ["training.lr"])
    path = tmp_path / "broken.yaml"
    path.write_text("training: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(path)


CONFIG_FOLDERS = (REPO / "configs", REPO / "bench" / "gpu" / "configs")  # the ready configs, the lab machine's
SHIPPED = sorted(str(path.relative_to(REPO)) for folder in CONFIG_FOLDERS for path in folder.glob("*.yaml"))


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_configs_load_and_round_trip(name, tmp_path):
    cfg = load_config(REPO / name)
    dumped = tmp_path / "dumped.yaml"
    dumped.write_text(dump_config(cfg))
    assert load_config(dumped) == cfg


def test_several_responses_per_prompt_need_a_temperature():
    with pytest.raises(ConfigError, match=r"sampling\.responses_per_prompt 2 needs sampling\.temperature > 0"):
        load_config(None, ["sampling.responses_per_prompt=2"])
    config = load_config(None, ["sampling.responses_per_prompt=2", "sampling.temperature=0.7"])
    assert config.sampling.responses_per_prompt == 2


def test_an_unquoted_on_or_off_is_the_switch_word_not_a_boolean(tmp_path):
    """YAML reads `on`/`off` as booleans; the H200 run typed `--set extraction.reuse_sampling_server=on`."""
    config = load_config(None, ["extraction.reuse_sampling_server=on", "training.compile=off"])
    assert (config.extraction.reuse_sampling_server, config.training.compile) == ("on", "off")
    path = tmp_path / "c.yaml"
    path.write_text("extraction:\n  reuse_sampling_server: off\ntraining:\n  compile: on\n")
    config = load_config(path)
    assert (config.extraction.reuse_sampling_server, config.training.compile) == ("off", "on")
    with pytest.raises(ConfigError, match=r"extraction\.reuse_sampling_server"):
        load_config(None, ["extraction.reuse_sampling_server=1"])


@pytest.mark.parametrize(
    ("override", "reason"),
    [
        ("server.dtype=bf16", "server.dtype: Input should be 'auto', 'bfloat16', 'float16' or 'float32' (got 'bf16')"),
        ("extraction.compute_dtype=half", "extraction.compute_dtype: Input should be 'auto', 'bfloat16', 'float16'"),
        ("evaluation.dtype=float16", "evaluation.dtype: Input should be 'auto', 'float32' or 'bfloat16'"),
        ("training.device=gpu", "training.device: 'gpu' is not a device: use auto, cpu, cuda or cuda:N"),
        ("extraction.device=cuda:x", "extraction.device: 'cuda:x' is not a device"),
        ("evaluation.device=tpu", "evaluation.device: 'tpu' is not a device"),
    ],
)
def test_dtypes_and_devices_outside_their_set_fail_at_load_not_at_engine_start(override, reason):
    """`--set server.dtype=bf16` used to pass and fail only when vLLM started."""
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert reason in str(err.value)


def test_the_values_dtypes_and_devices_take():
    config = load_config(None, ["server.dtype=bfloat16", "training.device=cuda:1", "extraction.device=cpu"])
    assert (config.server.dtype, config.training.device, config.extraction.device) == ("bfloat16", "cuda:1", "cpu")
    assert PipelineConfig().server.dtype == PipelineConfig().evaluation.device == "auto"


@pytest.mark.parametrize(
    ("override", "line"),
    [
        ("training.epochs=-1", "  training.epochs: Input should be 'auto' or greater than 0 (got -1)"),
        ("training.processes=0", "  training.processes: Input should be 'auto' or greater than 0 (got 0)"),
        ("extraction.layer_ids=[1, x]", "  extraction.layer_ids.1: Input should be a valid integer, unable to parse"),
        ("server.env={A: [1]}", "  server.env.A: Input should be a valid string (got [1])"),
        ("sampling.responses_per_prompt=2", "  sampling: sampling.responses_per_prompt 2 needs sampling.temperature"),
    ],
)
def test_errors_name_the_users_field_path_not_pydantics(override, line):
    """Union members (`literal['auto']`, `constrained-float`) and the `Value error, ` prefix stay inside pydantic;
    a model check's message is not followed by the whole section it was given."""
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    [reported] = str(err.value).splitlines()[1:]
    assert reported.startswith(line)
    assert "constrained" not in reported and "literal[" not in reported and "(got {" not in reported


def test_export_engines_with_sglang_refuse_a_flag_sglang_does_not_read_when_asked_for(tmp_path):
    assert load_config(overrides=["export.engines=[vllm, sglang]"]).training.norm_before_residual  # turned off later
    path = tmp_path / "c.yaml"
    path.write_text("export:\n  engines: [vllm, sglang]\ntraining:\n  norm_before_residual: true\n")
    with pytest.raises(ConfigError, match=r"training.norm_before_residual: SGLang does not read it") as err:
        load_config(path)
    assert str(path) in str(err.value)
    assert not load_config(path, ["export.engines=[vllm]"]).export.engines.count("sglang")  # vLLM reads it
    with pytest.raises(ConfigError, match="name each engine once"):
        load_config(overrides=["export.engines=[vllm, vllm]"])
    with pytest.raises(ConfigError, match=r"export\.engines"):
        load_config(overrides=["export.engines=[]"])
