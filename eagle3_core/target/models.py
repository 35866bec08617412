"""Facts about target models every phase shares: the auxiliary layer ids, reading single tensors
without loading the model, and tiny randomly initialised targets for fast tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

EMBED_NAMES = ("model.embed_tokens.weight", "model.embed.weight", "transformer.wte.weight")
NORM_NAMES = ("model.norm.weight", "transformer.ln_f.weight")
LM_HEAD_NAMES = ("lm_head.weight",)

# Role names accepted by `load_target_tensors`, each resolved to the first name the checkpoint has.
ROLES = {"embed_tokens": EMBED_NAMES, "norm": NORM_NAMES, "lm_head": LM_HEAD_NAMES}


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """The auxiliary layers an EAGLE-3 draft reads: `[2, N//2, N-3]` for a target with N decoder layers.

    Ids follow vLLM's convention: id i is the input to decoder layer i, i.e. the state after i layers,
    which is `output_hidden_states[i]` in transformers (index 0 is the embedding output). The same ids are
    used at extraction and written into the draft's `eagle_aux_hidden_state_layer_ids`; if the two differ
    by one, vLLM feeds the draft states it was never trained on and acceptance silently drops to ~1.
    """
    if num_layers < 6:
        raise ValueError(f"a target needs at least 6 decoder layers for aux ids [2, N//2, N-3]; got {num_layers}")
    return [2, num_layers // 2, num_layers - 3]


def check_layer_ids(layer_ids: list[int], num_layers: int) -> None:
    """Aux ids must be distinct, ascending and inside [1, N-1] (the state after N layers is the last)."""
    if len(layer_ids) != 3 or sorted(set(layer_ids)) != list(layer_ids):
        raise ValueError(f"layer ids must be 3 distinct ascending ids, got {layer_ids}")
    if layer_ids[0] < 1 or layer_ids[-1] > num_layers - 1:
        raise ValueError(f"layer ids {layer_ids} do not fit a target with {num_layers} layers")


def _weight_map(model_dir: Path) -> dict[str, str]:
    """Tensor name -> safetensors file, from the index or the single-file checkpoint."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        return json.loads(index.read_text())["weight_map"]
    single = model_dir / "model.safetensors"
    if not single.exists():
        raise FileNotFoundError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")
    with safe_open(single, framework="pt") as f:
        return dict.fromkeys(f.keys(), "model.safetensors")


def _text_config(model_dir: Path) -> dict:
    config = json.loads((model_dir / "config.json").read_text())
    return config.get("text_config", config)


def load_target_tensors(model_dir: Path | str, roles: list[str]) -> dict[str, torch.Tensor]:
    """Read only the named tensors (`embed_tokens`, `norm`, `lm_head`) from a safetensors checkpoint.

    Each file is opened lazily and only the requested tensors are read, so a 1T-parameter target costs a
    few GB here, not a weight load. A tied `lm_head` (no tensor of its own) returns the embeddings.
    """
    model_dir = Path(model_dir)
    weight_map = _weight_map(model_dir)
    tied = _text_config(model_dir).get("tie_word_embeddings", False)
    names: dict[str, str] = {}
    for role in roles:
        if role not in ROLES:
            raise KeyError(f"unknown tensor role {role!r}; known: {sorted(ROLES)}")
        found = next((n for n in ROLES[role] if n in weight_map), None)
        if found is None and role == "lm_head" and tied:
            found = next((n for n in EMBED_NAMES if n in weight_map), None)
        if found is None:
            raise KeyError(f"{model_dir}: no tensor for {role} (looked for {ROLES[role]})")
        names[role] = found
    tensors: dict[str, torch.Tensor] = {}
    by_file: dict[str, list[str]] = {}
    for role, name in names.items():
        by_file.setdefault(weight_map[name], []).append(role)
    for file, file_roles in by_file.items():
        with safe_open(model_dir / file, framework="pt") as f:
            for role in file_roles:
                tensors[role] = f.get_tensor(names[role])
    return tensors


def tiny_llama_config(vocab_size: int = 49152, num_layers: int = 8, hidden_size: int = 64):
    """A Llama config small enough for unit tests, with the embedded target's vocabulary."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden_size // 4,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )


def tiny_deepseek_v3_config(vocab_size: int = 49152, num_layers: int = 8, hidden_size: int = 64):
    """A DeepSeek-V3-shaped config (MLA attention, MoE) at test size: the seeds' Kimi-K2.5 architecture."""
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        moe_intermediate_size=hidden_size,
        num_hidden_layers=num_layers,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )


def build_tiny_target(out_dir: Path | str, tokenizer_dir: Path | str, arch: str = "llama", seed: int = 0) -> Path:
    """Save a randomly initialised target (`llama` or `deepseek_v3`) with the tokenizer of
    `tokenizer_dir` to `out_dir`, as a Hugging Face folder every phase can read."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out_dir = Path(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    builders = {"llama": tiny_llama_config, "deepseek_v3": tiny_deepseek_v3_config}
    config = builders[arch](vocab_size=len(tokenizer))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
