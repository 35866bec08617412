"""Fake target manifests (no weights) for tests that read only their fields."""

from __future__ import annotations

import json
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


# Kimi-K2.5's config.json (the multimodal wrapper, its DeepSeek-V3-shaped text model under `text_config`: MLA
# attention, 384 routed experts), kept as published in tests/data.
KIMI_CONFIG = json.loads((Path(__file__).parents[1] / "data/target_configs/kimi-k2.5/config.json").read_text())
KIMI_TEXT = KIMI_CONFIG["text_config"]
KIMI_LAYERS, KIMI_HIDDEN, KIMI_VOCAB, KIMI_HEADS, KIMI_INTERMEDIATE = (
    KIMI_TEXT[k] for k in ("num_hidden_layers", "hidden_size", "vocab_size", "num_attention_heads", "intermediate_size")
)
