"""A fake target manifest (no weights) for tests that read only its fields."""

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
