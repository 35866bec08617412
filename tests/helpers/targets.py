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
