"""Random-weight targets of the seeds' shapes, written as Hugging Face folders (config.json, safetensors shards
with their index, the embedded target's tokenizer) so every phase reads them as it reads a real checkpoint:

- `kimi`: Kimi-K2.5's architecture (DeepSeek-V3: MLA attention, sigmoid-routed MoE with a shared expert, the
  first layer dense) cut to a few layers and experts, with Kimi's own compressed-tensors W4A16 quantization
  (int4 routed experts, groups of 32, `pack-quantized`; attention, shared experts, dense MLP and lm_head
  unquantized): vLLM takes the same Marlin MoE path as for Kimi's INT4 checkpoint.
- `llama8b`: Llama-3.1-8B's shape in bf16, for extraction throughput against the engine's own limit.

Real random safetensors rather than vLLM's `--load-format dummy`: training reads the target's embeddings
and lm_head from the checkpoint, and the `hf` backend loads the same weights vLLM serves. Imports only torch
and safetensors (the GPU host has no pydantic):

    python3 -m bench.gpu.random_targets kimi OUT_DIR --tokenizer SMOLLM2_DIR [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any, NamedTuple

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
SHARD_BYTES = 2 * 2**30
INT4_PER_INT32 = 8
GROUP_SIZE = 32  # Kimi-K2.5's own
# Kimi-K2.5's `quantization_config` as its INT4 checkpoint writes it: only the routed experts are int4.
KIMI_QUANTIZATION: dict[str, Any] = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "quantization_status": "compressed",
    "kv_cache_scheme": None,
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "input_activations": None,
            "output_activations": None,
            "weights": {
                "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": GROUP_SIZE,
                "dynamic": False, "actorder": None, "block_structure": None, "observer": "minmax",
                "observer_kwargs": {},
            },
        }
    },
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
}  # fmt: skip


class Tensor(NamedTuple):
    """One checkpoint tensor: its shape and how it is filled."""

    shape: tuple[int, ...]
    fill: str  # "normal" (std 0.02), "ones", "zeros_f32", "int4_packed", "int4_scale", "shape"


def kimi_like_config(vocab_size: int, layers: int = 8, experts: int = 16) -> dict[str, Any]:
    """DeepSeek-V3/Kimi-K2.5 config at a size one GPU serves in seconds: Kimi's MLA ranks and head dims
    (kv_lora_rank 512 + rope 64: the latent width MLA kernels are built for), hidden 2048, 16 heads."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "torch_dtype": "bfloat16",
        "vocab_size": vocab_size, "hidden_size": 2048, "intermediate_size": 4096, "moe_intermediate_size": 512,
        "num_hidden_layers": layers, "first_k_dense_replace": 1, "moe_layer_freq": 1,
        "num_attention_heads": 16, "num_key_value_heads": 16,
        "n_routed_experts": experts, "n_shared_experts": 1, "num_experts_per_tok": 4,
        "n_group": 1, "topk_group": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
        "norm_topk_prob": True, "routed_scaling_factor": 2.827,
        "q_lora_rank": 768, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
        "v_head_dim": 128, "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 50000.0,
        "max_position_embeddings": 4096, "tie_word_embeddings": False, "attention_bias": False,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2, "initializer_range": 0.02,
        "quantization_config": KIMI_QUANTIZATION,
    }  # fmt: skip


def llama_8b_config(vocab_size: int = 128256, layers: int = 32) -> dict[str, Any]:
    """Llama-3.1-8B's shape (GQA 32/8, intermediate 14336, vocabulary 128256)."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "bfloat16",
        "vocab_size": vocab_size, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": layers,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "hidden_act": "silu",
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 8192,
        "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2, "initializer_range": 0.02,
    }  # fmt: skip


def mlp_tensors(prefix: str, hidden: int, inner: int) -> dict[str, Tensor]:
    return {
        f"{prefix}.gate_proj.weight": Tensor((inner, hidden), "normal"),
        f"{prefix}.up_proj.weight": Tensor((inner, hidden), "normal"),
        f"{prefix}.down_proj.weight": Tensor((hidden, inner), "normal"),
    }


def int4_linear(prefix: str, out_features: int, in_features: int) -> dict[str, Tensor]:
    """A compressed-tensors pack-quantized linear: int4 values packed 8 to an int32 along the input."""
    return {
        f"{prefix}.weight_packed": Tensor((out_features, in_features // INT4_PER_INT32), "int4_packed"),
        f"{prefix}.weight_scale": Tensor((out_features, in_features // GROUP_SIZE), "int4_scale"),
        f"{prefix}.weight_shape": Tensor((2,), "shape"),
    }


def edge_tensors(config: dict[str, Any]) -> dict[str, Tensor]:
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    return {
        "model.embed_tokens.weight": Tensor((vocab, hidden), "normal"),
        "model.norm.weight": Tensor((hidden,), "ones"),
        "lm_head.weight": Tensor((vocab, hidden), "normal"),
    }


def layer_norms(prefix: str, hidden: int) -> dict[str, Tensor]:
    return {
        f"{prefix}.input_layernorm.weight": Tensor((hidden,), "ones"),
        f"{prefix}.post_attention_layernorm.weight": Tensor((hidden,), "ones"),
    }


def llama_tensors(config: dict[str, Any]) -> dict[str, Tensor]:
    """Every tensor of a Llama checkpoint, by its Hugging Face name."""
    hidden, heads, kv_heads = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config["head_dim"]
    tensors = edge_tensors(config)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        tensors |= (
            layer_norms(p, hidden)
            | {
                f"{p}.self_attn.q_proj.weight": Tensor((heads * head_dim, hidden), "normal"),
                f"{p}.self_attn.k_proj.weight": Tensor((kv_heads * head_dim, hidden), "normal"),
                f"{p}.self_attn.v_proj.weight": Tensor((kv_heads * head_dim, hidden), "normal"),
                f"{p}.self_attn.o_proj.weight": Tensor((hidden, heads * head_dim), "normal"),
            }
            | mlp_tensors(f"{p}.mlp", hidden, config["intermediate_size"])
        )
    return tensors


def mla_tensors(prefix: str, config: dict[str, Any]) -> dict[str, Tensor]:
    """DeepSeek-V3's multi-head latent attention: low-rank q, a shared latent kv plus one rope key."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    q_rank, kv_rank, rope = config["q_lora_rank"], config["kv_lora_rank"], config["qk_rope_head_dim"]
    nope, v_dim = config["qk_nope_head_dim"], config["v_head_dim"]
    return {
        f"{prefix}.q_a_proj.weight": Tensor((q_rank, hidden), "normal"),
        f"{prefix}.q_a_layernorm.weight": Tensor((q_rank,), "ones"),
        f"{prefix}.q_b_proj.weight": Tensor((heads * (nope + rope), q_rank), "normal"),
        f"{prefix}.kv_a_proj_with_mqa.weight": Tensor((kv_rank + rope, hidden), "normal"),
        f"{prefix}.kv_a_layernorm.weight": Tensor((kv_rank,), "ones"),
        f"{prefix}.kv_b_proj.weight": Tensor((heads * (nope + v_dim), kv_rank), "normal"),
        f"{prefix}.o_proj.weight": Tensor((hidden, heads * v_dim), "normal"),
    }


def moe_tensors(prefix: str, config: dict[str, Any], quantized: bool) -> dict[str, Tensor]:
    """The router (with DeepSeek-V3's score-correction bias), the shared expert and the routed experts."""
    hidden, inner, experts = config["hidden_size"], config["moe_intermediate_size"], config["n_routed_experts"]
    tensors = {
        f"{prefix}.gate.weight": Tensor((experts, hidden), "normal"),
        f"{prefix}.gate.e_score_correction_bias": Tensor((experts,), "zeros_f32"),
    } | mlp_tensors(f"{prefix}.shared_experts", hidden, inner * config["n_shared_experts"])
    for e in range(experts):
        expert = f"{prefix}.experts.{e}"
        if quantized:
            tensors |= int4_linear(f"{expert}.gate_proj", inner, hidden)
            tensors |= int4_linear(f"{expert}.up_proj", inner, hidden)
            tensors |= int4_linear(f"{expert}.down_proj", hidden, inner)
        else:
            tensors |= mlp_tensors(expert, hidden, inner)
    return tensors


def deepseek_tensors(config: dict[str, Any]) -> dict[str, Tensor]:
    """Every tensor of a DeepSeek-V3 checkpoint; routed experts int4-packed where the config quantizes."""
    hidden, quantized = config["hidden_size"], "quantization_config" in config
    tensors = edge_tensors(config)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        tensors |= layer_norms(p, hidden) | mla_tensors(f"{p}.self_attn", config)
        if i < config["first_k_dense_replace"]:
            tensors |= mlp_tensors(f"{p}.mlp", hidden, config["intermediate_size"])
        else:
            tensors |= moe_tensors(f"{p}.mlp", config, quantized)
    return tensors


def checkpoint_tensors(config: dict[str, Any]) -> dict[str, Tensor]:
    return deepseek_tensors(config) if config["model_type"] == "deepseek_v3" else llama_tensors(config)


def filled(spec: Tensor, generator: torch.Generator, device: str) -> torch.Tensor:
    """A random tensor for `spec` (bf16 weights of std 0.02; int4 scales that give the same spread)."""
    if spec.fill == "normal":
        return (torch.randn(spec.shape, generator=generator, device=device) * 0.02).to(torch.bfloat16)
    if spec.fill == "ones":
        return torch.ones(spec.shape, dtype=torch.bfloat16, device=device)
    if spec.fill == "zeros_f32":
        return torch.zeros(spec.shape, dtype=torch.float32, device=device)
    if spec.fill == "int4_packed":
        return torch.randint(-(2**31), 2**31 - 1, spec.shape, generator=generator, device=device, dtype=torch.int32)
    if spec.fill == "int4_scale":  # symmetric int4 values -8..7 have std ~4.6: 0.02 / 4.6
        return torch.full(spec.shape, 0.0043, dtype=torch.bfloat16, device=device)
    raise ValueError(f"unknown fill {spec.fill!r}")


def write_random_target(out_dir: Path, config: dict[str, Any], tokenizer_dir: Path, device: str = "cpu") -> int:
    """Write `config`'s checkpoint with random weights to `out_dir`; returns the bytes of weights written."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out_dir / name)
    generator = torch.Generator(device=device).manual_seed(0)
    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes, weight_map, total = 0, {}, 0
    specs = checkpoint_tensors(config)
    for name, spec in specs.items():
        if spec.fill == "shape":  # (out, in) of the unpacked weight, as compressed-tensors writes it
            out_features, packed = specs[name.replace("weight_shape", "weight_packed")].shape
            tensor = torch.tensor([out_features, packed * INT4_PER_INT32], dtype=torch.int64)
        else:
            tensor = filled(spec, generator, device)
        size = tensor.numel() * tensor.element_size()
        if shard_bytes + size > SHARD_BYTES and shards[-1]:
            shards.append({})
            shard_bytes = 0
        shards[-1][name] = tensor.cpu()
        shard_bytes += size
        total += size
    for index, tensors in enumerate(shards):
        file = f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, out_dir / file, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(tensors, file)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shape", choices=["kimi", "llama8b"])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--tokenizer", type=Path, required=True, help="folder with the tokenizer files")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    if args.shape == "kimi":  # the tokenizer's vocabulary; the 8B shape keeps Llama-3.1's 128256, a superset
        config = kimi_like_config(len(json.loads((args.tokenizer / "tokenizer.json").read_text())["model"]["vocab"]))
    else:
        config = llama_8b_config()
    total = write_random_target(args.out_dir, config, args.tokenizer, args.device)
    print(json.dumps({"shape": args.shape, "out_dir": str(args.out_dir), "weight_bytes": total}))


if __name__ == "__main__":
    main()
