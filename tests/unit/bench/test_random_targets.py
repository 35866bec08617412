"""The random-weight targets of the GPU runs (`bench/gpu/random_targets.py`), at test size: every tensor has
the name and shape the checkpoint format gives it, so transformers loads the unquantized folders with nothing
missing or unexpected, and the W4A16 experts follow compressed-tensors' pack-quantized layout."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from bench.gpu.random_targets import (
    GROUP_SIZE,
    KIMI_QUANTIZATION,
    checkpoint_tensors,
    kimi_like_config,
    llama_8b_config,
    write_random_target,
)
from eagle3_core.target.prepare import describe_folder

SMALL = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "vocab_size": 49152}


def small_llama() -> dict:
    return llama_8b_config() | SMALL | {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32}


def small_kimi() -> dict:
    return kimi_like_config(49152, experts=4) | SMALL | {
        "moe_intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 64,
    }  # fmt: skip


def tensors_of(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in folder.glob("*.safetensors"):
        with safe_open(file, "pt") as handle:
            out |= {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
    return out


@pytest.mark.parametrize("name", ["llama", "deepseek_v3"])
def test_transformers_loads_every_tensor_by_its_name(name, smollm2_target, tmp_path):
    from transformers import AutoModelForCausalLM

    config = small_llama() if name == "llama" else {k: v for k, v in small_kimi().items() if k != "quantization_config"}
    write_random_target(tmp_path, config, smollm2_target.root_path)
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True, dtype=torch.bfloat16)
    assert not any(info.values()), info
    written = tensors_of(tmp_path)["model.embed_tokens.weight"]
    assert torch.equal(model.get_input_embeddings().weight, written) and written.std() > 0.01


def test_kimis_routed_experts_are_int4_packed_and_everything_else_is_as_unquantized(smollm2_target, tmp_path):
    config = small_kimi()
    write_random_target(tmp_path, config, smollm2_target.root_path)
    tensors = tensors_of(tmp_path)
    plain = checkpoint_tensors({k: v for k, v in config.items() if k != "quantization_config"})
    expert = "model.layers.1.mlp.experts.3.gate_proj"
    assert set(tensors) - {n for n in tensors if ".experts." in n} == {n for n in plain if ".experts." not in n}
    assert tensors[f"{expert}.weight_packed"].dtype == torch.int32
    assert tensors[f"{expert}.weight_packed"].shape == (64, 128 // 8)  # 8 int4 values an int32, along the input
    assert tensors[f"{expert}.weight_scale"].shape == (64, 128 // GROUP_SIZE)
    assert tensors[f"{expert}.weight_shape"].tolist() == [64, 128]
    assert tensors["model.layers.1.mlp.experts.0.down_proj.weight_shape"].tolist() == [128, 64]
    assert "model.layers.0.mlp.gate_proj.weight" in tensors  # the first layer stays dense, as Kimi's
    target = describe_folder(tmp_path, "kimi", "local")
    assert (target.model_type, target.num_layers, target.recorded_text.kv_lora_rank) == ("deepseek_v3", 2, 512)
    assert KIMI_QUANTIZATION["config_groups"]["group_0"]["weights"]["group_size"] == GROUP_SIZE == 32
