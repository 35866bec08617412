"""How big a target is, from its config.json and safetensors index alone (no weight is read): its parameters,
the bytes its weights take on the GPUs, its attention heads, and the KV cache one token costs.

The weights' bytes come from the index's `metadata.total_size` where there is one (exact), else from the
safetensors files' sizes, else from the parameters counted from config.json at its dtype: `torch_dtype`
(2 bytes for bf16), fp8 checkpoints at one byte a linear weight, and compressed-tensors int4 checkpoints
(Kimi-K2.5) at 4 bits plus a bf16 scale per group for the weights they quantise. The count covers the
embeddings, the lm_head, attention (grouped-query or DeepSeek's latent attention) and the MLPs (dense,
or routed plus shared experts); norms and biases are left out (well under 0.1%).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3_core.files import UnreadableFile, read_json_object

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1}
KV_CACHE_BYTES = 2  # vLLM's KV cache at the bf16 compute dtype of a GPU


@dataclass(frozen=True)
class LinearCounts:
    """Parameters of a text config, split the way quantisation splits them."""

    embeddings: int  # embed_tokens plus an untied lm_head: never quantised
    attention: int
    dense_mlp: int  # dense MLPs and shared experts
    routed_experts: int

    @property
    def total(self) -> int:
        return self.embeddings + self.attention + self.dense_mlp + self.routed_experts


@dataclass(frozen=True)
class ModelSize:
    """A target's size. `weight_bytes` is what its weights take in GPU memory, whole (divide by the tensor-
    parallel width for a rank); `kv_bytes_per_token` the KV cache of one token over every layer."""

    parameters: int
    weight_bytes: int
    weight_source: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int | None
    num_key_value_heads: int | None
    kv_bytes_per_token: int
    latent_attention: bool  # MLA: one latent per token, copied on every rank rather than split

    def kv_bytes_per_token_per_rank(self, tensor_parallel_size: int) -> float:
        """The KV cache of one token on each rank: split over the KV heads (copies past their count), whole
        on every rank under latent attention."""
        if self.latent_attention or not self.num_key_value_heads:
            return self.kv_bytes_per_token
        return self.kv_bytes_per_token / min(tensor_parallel_size, self.num_key_value_heads)


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's config: `text_config` of a multimodal checkpoint (Kimi-K2.5), else the whole."""
    return config.get("text_config", config)


def head_dim(text: dict[str, Any]) -> int:
    return text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]


def attention_parameters(text: dict[str, Any]) -> int:
    """One layer's attention projections: DeepSeek's latent attention where `kv_lora_rank` is set, else
    grouped-query attention (q, k, v, o)."""
    hidden, heads = text["hidden_size"], text["num_attention_heads"]
    if text.get("kv_lora_rank"):
        qk_head = text["qk_nope_head_dim"] + text["qk_rope_head_dim"]
        q_rank = text.get("q_lora_rank")
        query = hidden * q_rank + q_rank * heads * qk_head if q_rank else hidden * heads * qk_head
        latent = hidden * (text["kv_lora_rank"] + text["qk_rope_head_dim"])
        key_value = text["kv_lora_rank"] * heads * (text["qk_nope_head_dim"] + text["v_head_dim"])
        return query + latent + key_value + heads * text["v_head_dim"] * hidden
    dim = head_dim(text)
    kv_heads = text.get("num_key_value_heads") or heads
    return 2 * hidden * heads * dim + 2 * hidden * kv_heads * dim


def moe_layers(text: dict[str, Any]) -> int:
    """Decoder layers whose MLP is a mixture of experts (DeepSeek's `first_k_dense_replace`, Qwen's
    `mlp_only_layers` and `decoder_sparse_step`); 0 for a dense model."""
    experts = text.get("n_routed_experts") or text.get("num_experts")
    if not experts:
        return 0
    layers = text["num_hidden_layers"]
    if "first_k_dense_replace" in text:
        return layers - text["first_k_dense_replace"]
    step = text.get("decoder_sparse_step", 1) or 1
    dense = set(text.get("mlp_only_layers") or [])
    return sum(1 for i in range(layers) if i not in dense and (i + 1) % step == 0)


def count_parameters(text: dict[str, Any]) -> LinearCounts:
    """The parameters of a text config (see the module docstring for what is counted)."""
    hidden, layers, vocab = text["hidden_size"], text["num_hidden_layers"], text["vocab_size"]
    tied = text.get("tie_word_embeddings", False)
    sparse = moe_layers(text)
    experts = text.get("n_routed_experts") or text.get("num_experts") or 0
    expert = 3 * hidden * (text.get("moe_intermediate_size") or 0)  # gate, up, down
    shared = (text.get("n_shared_experts") or 0) * expert
    dense_mlp = (layers - sparse) * 3 * hidden * text["intermediate_size"] + sparse * (shared + hidden * experts)
    return LinearCounts(
        embeddings=vocab * hidden * (1 if tied else 2),
        attention=layers * attention_parameters(text),
        dense_mlp=dense_mlp,
        routed_experts=sparse * experts * expert,
    )


def quantization(config: dict[str, Any]) -> dict[str, Any]:
    return config.get("quantization_config") or text_config(config).get("quantization_config") or {}


def weight_bytes_of(config: dict[str, Any], counts: LinearCounts) -> tuple[int, str]:
    """Bytes of the weights counted in `counts` at the checkpoint's dtype and quantisation, and how."""
    text = text_config(config)
    dtype = text.get("torch_dtype") or text.get("dtype") or config.get("torch_dtype") or "bfloat16"
    unquantised = DTYPE_BYTES.get(dtype, 2)
    quant = quantization(config)
    method = quant.get("quant_method")
    if method == "fp8":
        linear = counts.attention + counts.dense_mlp + counts.routed_experts
        return counts.embeddings * unquantised + linear, f"fp8 linear weights, {dtype} embeddings"
    groups = quant.get("config_groups") or {}
    weights = next(iter(groups.values()), {}).get("weights", {}) if groups else {}
    if method == "compressed-tensors" and weights.get("num_bits"):
        per_weight = weights["num_bits"] / 8 + unquantised / (weights.get("group_size") or 128)
        only_experts = any("self_attn" in pattern for pattern in quant.get("ignore", []))
        quantised = counts.routed_experts if only_experts else counts.total - counts.embeddings
        rest = counts.total - quantised
        what = "routed experts" if only_experts else "linear weights"
        return int(quantised * per_weight + rest * unquantised), f"int{weights['num_bits']} {what}, {dtype} rest"
    return counts.total * unquantised, dtype


def kv_bytes_per_token(text: dict[str, Any]) -> int:
    """KV cache bytes of one token over every layer: the latent and rope key under MLA, else K and V."""
    layers = text["num_hidden_layers"]
    if text.get("kv_lora_rank"):
        return layers * (text["kv_lora_rank"] + text["qk_rope_head_dim"]) * KV_CACHE_BYTES
    kv_heads = text.get("num_key_value_heads") or text["num_attention_heads"]
    return 2 * layers * kv_heads * head_dim(text) * KV_CACHE_BYTES


def checkpoint_bytes(model_dir: Path) -> tuple[int, str] | None:
    """The weights' bytes as the checkpoint states them: the index's total_size, else the files' sizes."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        total = json.loads(index.read_text()).get("metadata", {}).get("total_size")
        if total:
            return int(total), f"{index.name} total_size"
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        return sum(f.stat().st_size for f in files), f"{len(files)} safetensors file(s)"
    return None


def size_of_config(config: dict[str, Any], stated: tuple[int, str] | None = None) -> ModelSize:
    """A target's size from its config.json (a dict), with the checkpoint's own byte count where known."""
    text = text_config(config)
    counts = count_parameters(text)
    if stated is None:
        estimated, how = weight_bytes_of(config, counts)
        stated = estimated, f"config.json: {counts.total / 1e9:.2f}B parameters ({how})"
    return ModelSize(
        parameters=counts.total,
        weight_bytes=stated[0],
        weight_source=stated[1],
        num_layers=text["num_hidden_layers"],
        hidden_size=text["hidden_size"],
        num_attention_heads=text.get("num_attention_heads"),
        num_key_value_heads=None if text.get("kv_lora_rank") else text.get("num_key_value_heads"),
        kv_bytes_per_token=kv_bytes_per_token(text),
        latent_attention=bool(text.get("kv_lora_rank")),
    )


def model_size(model_dir: Path) -> ModelSize:
    """The size of the Hugging Face folder `model_dir` (config.json, and the index or files if present); a
    config.json that is not JSON, or lacks what a model's config states, is an `UnreadableFile` naming it."""
    path = model_dir / "config.json"
    remedy = "fix it, or download the target again"
    config = read_json_object(path, remedy)
    try:
        return size_of_config(config, checkpoint_bytes(model_dir))
    except KeyError as exc:
        raise UnreadableFile(f"{path}: has no {exc.args[0]}, which a model's config states; {remedy}") from None
