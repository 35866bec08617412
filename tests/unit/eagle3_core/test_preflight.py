"""Preflight: each heavy phase refuses to start, before any weight load, when its disk, target, layer ids,
port or GPUs do not fit, naming what is wrong in one error and one events.jsonl line."""

from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path

import pytest

from eagle3_core.artifacts import SampleSet, TargetModel, TargetText
from eagle3_core.config import PipelineConfig
from eagle3_core.evaluation.preflight import preflight_evaluation
from eagle3_core.events import PREFLIGHT, WEIGHT_LOAD, RunEvents
from eagle3_core.extraction.phase import extract_hidden_states
from eagle3_core.extraction.preflight import preflight_extraction, sample_set_target_problems
from eagle3_core.files import DiskFullError
from eagle3_core.kept import set_aside
from eagle3_core.preflight import (
    PreflightError,
    disk_problem,
    gpu_problem,
    port_problem,
    server_gpus,
    server_gpus_source,
)
from eagle3_core.run_layout import RunLayout
from eagle3_core.sampling.preflight import preflight_sampling
from eagle3_core.target.preflight import layer_problem, target_files_problems, tensor_parallel_problem
from eagle3_core.target.prepare import describe_folder
from eagle3_core.training.preflight import checkpoint_bytes, preflight_training
from tests.helpers.extraction_fixtures import build_sample_set


@pytest.fixture
def target_copy(tmp_path: Path, tiny_llama: TargetModel) -> TargetModel:
    """A private copy of the tiny target, free to be edited."""
    root = tmp_path / "target"
    shutil.copytree(tiny_llama.root_path, root)
    return describe_folder(root, "tiny-copy", "local")


def test_disk_problem_names_path_needed_and_free(tmp_path):
    assert disk_problem(tmp_path, 100, 100) is None
    problem = disk_problem(tmp_path, 2_000_000, 1_000)
    assert str(tmp_path) in problem and "2,000,000" in problem and "1,000" in problem
    assert "holds" not in disk_problem(tmp_path, 2_000_000, 1_000, kept=tmp_path / "kept")  # nothing kept


def test_a_disk_too_small_names_the_results_kept_of_other_settings(tmp_path, smollm2_target, target_copy):
    """A changed extraction setting set the old states aside (never deleted): when the new ones do not fit,
    the refusal says how much the kept ones hold and where, so the user can make the room."""
    config = PipelineConfig(run_dir=tmp_path / "run", extraction={"backend": "hf"})
    states = tmp_path / "run" / "hidden_states"
    states.mkdir(parents=True)
    (states / "shard-00000.safetensors").write_bytes(b"\0" * 5000)
    (states / "extraction.key.json").write_text("{}")
    set_aside(states, RunLayout.of(config).kept(states) / "0123456789abcdef", "extraction.key.json")
    sample_set = build_sample_set(tmp_path / "samples", smollm2_target.root_path, num_ok=2)
    with pytest.raises(PreflightError) as error:
        preflight_extraction(config, sample_set, target_copy, states, [2, 4, 5], 10**18, False, RunEvents(tmp_path))
    assert f"({tmp_path / 'run' / 'kept'} holds 5,002 bytes of other settings' results" in str(error.value)


def test_an_edited_tokenizer_or_config_is_caught(target_copy):
    assert target_files_problems(target_copy) == []
    (target_copy.root_path / "tokenizer_config.json").write_text("{}")
    problems = target_files_problems(target_copy)
    assert len(problems) == 1 and "tokenizer" in problems[0]
    (target_copy.root_path / "config.json").write_text("{}")
    assert any("config.json" in p for p in target_files_problems(target_copy))


def test_a_sample_set_of_another_tokenizer_or_target_is_refused(target_copy, tiny_llama):
    made_here = SampleSet(root="/x", tokenizer_digest=target_copy.tokenizer_digest, target_digest=target_copy.digest)
    assert sample_set_target_problems(made_here, target_copy) == []
    other = SampleSet(root="/x", tokenizer_digest="0" * 64, target_digest=tiny_llama.digest)
    problems = sample_set_target_problems(other, target_copy)
    assert len(problems) == 2
    assert "/x/sample_set.json: tokenizer_digest" in problems[0] and "another target" in problems[1]


def test_layer_ids_must_fit_the_target():
    assert layer_problem([2, 4, 5], 8, "extraction.layer_ids") is None
    problem = layer_problem([2, 4, 8], 8, "extraction.layer_ids")
    assert problem.startswith("extraction.layer_ids:") and "8 layers" in problem


def test_a_taken_port_is_named():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        config = PipelineConfig(server={"port": port})
        assert f"port {port}" in port_problem(config.server)
    assert port_problem(PipelineConfig(server={"port": 0}).server) is None


def test_gpus_must_be_visible_and_free():
    assert gpu_problem(0, 0, {}) is None
    assert gpu_problem(1, 1, {}) is None
    assert "needs 8 GPU(s), 1 visible" in gpu_problem(8, 1, {})
    assert "pid 4242 (70000 MiB)" in gpu_problem(1, 1, {4242: 70000})


def test_a_server_takes_tensor_times_data_parallel_gpus():
    server = PipelineConfig(server={"tensor_parallel_size": 4, "data_parallel_size": 2}).server
    assert server_gpus(server) == 8
    assert gpu_problem(server_gpus(server), 8, {}, server_gpus_source(server)) is None
    problem = gpu_problem(server_gpus(server), 4, {}, server_gpus_source(server))
    assert problem.startswith(
        "the phase needs 8 GPU(s) (server.tensor_parallel_size 4 x data_parallel_size 2), 4 visible"
    )


def test_a_tensor_parallel_size_that_does_not_split_the_heads_is_refused_before_the_engine_starts(
    tmp_path, smollm2_target
):
    """Seen on two H200s: SmolLM2-135M (9 heads, 3 KV heads) at tensor parallelism 2 made vLLM exit after its
    workers were up, once per try; the sampling preflight now refuses it, naming the field and the heads."""
    config = PipelineConfig(run_dir=tmp_path, server={"tensor_parallel_size": 2})
    events = RunEvents(tmp_path)
    with pytest.raises(PreflightError, match=r"server.tensor_parallel_size 2 does not divide .*'s 9 attention heads"):
        preflight_sampling(config, smollm2_target, tmp_path, 10, True, events)
    assert events.count(WEIGHT_LOAD) == 0
    draft_dir = tmp_path / "export"
    draft_dir.mkdir()
    (draft_dir / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))
    for engine in ("vllm", "sglang"):  # both split the heads by server.tensor_parallel_size
        with pytest.raises(PreflightError, match="9 attention heads"):
            preflight_evaluation(smollm2_target, draft_dir, engine, config.server, events)
    preflight_evaluation(smollm2_target, draft_dir, None, config.server, events)  # (b) not run: nothing starts
    assert tensor_parallel_problem(smollm2_target, 3) is None  # 9 heads and 3 KV heads over 3 ranks
    assert tensor_parallel_problem(smollm2_target, 9) is None  # 1 head each; each KV head on 3 ranks
    grouped = smollm2_target.model_copy(update={"text": TargetText(num_attention_heads=8, num_key_value_heads=3)})
    assert "3 KV heads" in tensor_parallel_problem(grouped, 2)
    mla = smollm2_target.model_copy(update={"text": TargetText(num_attention_heads=8, kv_lora_rank=512)})
    assert tensor_parallel_problem(mla, 2) is None


def test_checkpoint_estimate_grows_with_kept_states():
    assert checkpoint_bytes(1000, 1) == 2 * 12_000 + 4000
    assert checkpoint_bytes(1000, 3) > checkpoint_bytes(1000, 1)


def test_extraction_preflight_fails_before_any_weight_load_and_logs_one_line(tmp_path, smollm2_target, target_copy):
    sample_set = build_sample_set(tmp_path / "samples", smollm2_target.root_path, num_ok=4)
    config = PipelineConfig(run_dir=tmp_path / "run", extraction={"backend": "hf", "layer_ids": [2, 4, 5]})
    events = RunEvents(config.run_dir)
    (target_copy.root_path / "tokenizer.json").write_text("{}")
    with pytest.raises(PreflightError, match="tokenizer files changed"):
        extract_hidden_states(config, sample_set, target_copy, events)
    assert events.count(WEIGHT_LOAD) == 0
    [line] = [e for e in events.read() if e["event"] == PREFLIGHT]
    assert line["ok"] is False and line["phase"] == "extraction" and "tokenizer" in line["message"]
    assert not list((tmp_path / "run" / "hidden_states").glob("shard-*"))


def test_extraction_preflight_lists_every_problem(tmp_path, target_copy):
    events = RunEvents(tmp_path)
    config = PipelineConfig(run_dir=tmp_path, extraction={"backend": "hf"})
    sample_set = SampleSet(root=str(tmp_path), tokenizer_digest="0" * 64)
    with pytest.raises(PreflightError) as error:
        preflight_extraction(config, sample_set, target_copy, tmp_path, [2, 4, 99], 10**18, True, events)
    message = str(error.value)
    assert "extraction.layer_ids" in message and "bytes are free" in message and "tokenizer_digest" in message


def test_training_preflight_counts_the_drafts_checkpoints(tmp_path, target_copy):
    events = RunEvents(tmp_path)
    config = PipelineConfig(run_dir=tmp_path)
    hidden = type("Hidden", (), {"layer_ids": [2, 4, 5]})()
    preflight_training(config, hidden, target_copy, 1000, tmp_path, events)
    [line] = events.read()
    assert line["ok"] is True and line["draft_parameters"] > 0
    assert line["disk_needed"] == checkpoint_bytes(line["draft_parameters"], config.training.keep_checkpoints)


def test_training_preflight_refuses_an_mla_draft_for_a_target_without_mla(tmp_path, target_copy):
    events = RunEvents(tmp_path)
    config = PipelineConfig(run_dir=tmp_path, training={"draft_architecture": "deepseek_mla"})
    hidden = type("Hidden", (), {"layer_ids": [2, 4, 5]})()
    with pytest.raises(PreflightError, match=r"training\.draft_architecture: .*needs an MLA target"):
        preflight_training(config, hidden, target_copy, 1000, tmp_path, events)
    [line] = events.read()
    assert line["ok"] is False and str(target_copy.root_path / "config.json") in line["message"]


def test_disk_full_and_preflight_failures_are_never_retried():
    """A retry would fail the same way (after another weight load) until the user acts."""
    from tasks.policy import is_deterministic

    disk_full = DiskFullError(Path("/run/hidden_states/shard-00003.safetensors"), 10**9, 10**6)
    wrapped = RuntimeError("writing a shard failed")
    wrapped.__cause__ = disk_full
    assert is_deterministic(disk_full) and is_deterministic(wrapped)
    assert is_deterministic(PreflightError("preflight of extraction failed"))
    assert not is_deterministic(OSError(5, "Input/output error"))
