"""Fake target manifests (no weights) for tests that read only their fields."""

from __future__ import annotations

from pathlib import Path

from eagle3_core.artifacts import TargetModel

VOCAB = 50


def fake_target(root: Path) -> TargetModel:
    return TargetModel(
        root=str(root),
        name="fake",
        source="local",
        architecture="LlamaForCausalLM",
        model_type="llama",
        num_layers=8,
        hidden_size=16,
        vocab_size=VOCAB,
        tie_word_embeddings=True,
        config_digest="c",
        tokenizer_digest="t",
        chat_template=None,
    )


def smollm2_shaped_target() -> TargetModel:
    """A manifest of SmolLM2-135M's shape (30 layers, hidden 576, its vocabulary) whose folder does not exist:
    for the tests of cache keys, which read only its fields and digest."""
    return TargetModel.model_validate(
        {
            "root": "/nowhere",
            "name": "t",
            "source": "local",
            "architecture": "LlamaForCausalLM",
            "model_type": "llama",
            "num_layers": 30,
            "hidden_size": 576,
            "vocab_size": 49152,
            "tie_word_embeddings": True,
            "config_digest": "c",
            "tokenizer_digest": "t",
            "chat_template": None,
        }
    )


# Kimi-K2.5's text config (DeepSeek-V3-shaped: MLA attention, 384 routed experts), as its config.json nests it
# under `text_config`.
KIMI_LAYERS, KIMI_HIDDEN, KIMI_VOCAB, KIMI_HEADS, KIMI_INTERMEDIATE = 61, 7168, 163840, 64, 18432
KIMI_TEXT = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "kimi_k2",
    "vocab_size": KIMI_VOCAB,
    "hidden_size": KIMI_HIDDEN,
    "intermediate_size": KIMI_INTERMEDIATE,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": KIMI_LAYERS,
    "first_k_dense_replace": 1,
    "num_attention_heads": KIMI_HEADS,
    "num_key_value_heads": KIMI_HEADS,
    "n_routed_experts": 384,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "n_group": 1,
    "topk_group": 1,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "rms_norm_eps": 1e-5,
    "rope_theta": 50000.0,
    "max_position_embeddings": 262144,
    "tie_word_embeddings": False,
    "bos_token_id": 163584,
    "eos_token_id": 163585,
}
