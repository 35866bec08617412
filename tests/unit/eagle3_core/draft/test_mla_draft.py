"""The MLA draft (`training.draft_architecture: deepseek_mla`, vLLM's `deepseek_eagle3`): its step against
vLLM's own math (absorbed latent attention, vLLM's rotary embedding), TTT attention with keys wider than
values, the decoding chain equal to the training unroll, and the export vLLM loads."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from pydantic import ValidationError
from safetensors.torch import load_file, save_file

from eagle3_core.config import PipelineConfig
from eagle3_core.draft.export import check_checkpoint, checkpoint_tensors, config_from_hf, export_draft, load_exported
from eagle3_core.draft.model import DraftConfig, DraftKVCache, Eagle3Draft
from eagle3_core.evaluation.speculative import propose_chain
from eagle3_core.training.attention import document_causal_mask, merge_diagonal, ttt_attention_eager
from eagle3_core.training.distributed import projection_layout
from tests.helpers.drafts import (
    HEADS,
    KV_RANK,
    NOPE,
    ROPE,
    V_DIM,
    assert_chain_equals_unroll,
    mla_config,
    reference_ttt_attention,
    seeded_draft,
)

RECIPE = {"fc_norm": True, "norm_before_residual": True, "norm_output": True}


def mla_draft(q_lora_rank: int | None = 10, seed: int = 0, **flags: bool) -> Eagle3Draft:
    """A float64 MLA draft whose norm weights are random too (a norm skipped or applied twice shows)."""
    draft = seeded_draft(mla_config(q_lora_rank, **flags), seed)
    with torch.no_grad():
        for param in draft.parameters():
            if param.ndim == 1:
                param.uniform_(0.5, 1.5)
    return draft.double()


def vllm_rotary(positions: torch.Tensor, q_pe: torch.Tensor, k_pe: torch.Tensor, theta: float):
    """vLLM's own rotary embedding as its MLA layer builds it (`get_rope(..., is_neox_style=False)`)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(
            ROPE, max_position=64, rope_parameters={"rope_type": "default", "rope_theta": theta}, is_neox_style=False
        )
    return rope.forward_native(positions, q_pe.float(), k_pe.float())


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def vllm_reference_logits(draft: Eagle3Draft, aux: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Logits of n tokens at positions 0..n-1 (one causal prefill), written from vLLM 0.32's MLA layer
    (`MultiHeadLatentAttentionWrapper.forward`) and its kernels' absorbed form: scores q_nope W_UK . c_kv +
    q_pe . k_pe over the latent cache, output (probs @ c_kv) W_UV, then o_proj; layer and norms as
    `deepseek_eagle3`."""
    c, eps, layer = draft.config, draft.config.rms_norm_eps, draft.midlayer
    attn = layer.self_attn
    flat = aux.flatten(-2)  # [n, 3H]
    if c.fc_norm:
        flat = torch.cat([rms(p, n.weight, eps) for p, n in zip(flat.chunk(3, -1), draft.fc_norm, strict=True)], -1)
    hidden = flat @ draft.fc.weight.T  # [n, H]
    normed_hidden = rms(hidden, layer.hidden_norm.weight, eps)
    residual = normed_hidden if c.norm_before_residual else hidden
    x = torch.cat([rms(draft.embed_tokens.weight[tokens], layer.input_layernorm.weight, eps), normed_hidden], -1)
    q_c = x @ attn.q_a_proj.weight.T
    kv_lora = x @ attn.kv_a_proj_with_mqa.weight.T
    kv_c, k_pe = kv_lora.split([KV_RANK, ROPE], -1)
    kv_c = rms(kv_c, attn.kv_a_layernorm.weight, eps)  # [n, R]: the latent cache
    q = (rms(q_c, attn.q_a_layernorm.weight, eps) @ attn.q_b_proj.weight.T).view(-1, HEADS, NOPE + ROPE)
    positions = torch.arange(len(tokens))
    q_pe, k_pe = vllm_rotary(positions, q[..., NOPE:].clone(), k_pe[:, None].clone(), c.rope_theta)
    w_kv = attn.kv_b_proj.weight.view(HEADS, NOPE + V_DIM, KV_RANK)
    w_uk, w_uv = w_kv[:, :NOPE], w_kv[:, NOPE:]  # [heads, nope, R], [heads, Dv, R]
    q_latent = torch.einsum("nhd,hdr->nhr", q[..., :NOPE], w_uk)  # [n, heads, R]
    scores = torch.einsum("nhr,mr->hnm", q_latent, kv_c) + torch.einsum(
        "nhd,md->hnm", q_pe.double(), k_pe[:, 0].double()
    )
    scores = (scores * (NOPE + ROPE) ** -0.5).masked_fill(
        ~torch.ones(len(tokens), len(tokens)).tril().bool(), -torch.inf
    )
    out_latent = torch.einsum("hnm,mr->nhr", scores.softmax(-1), kv_c)
    out = torch.einsum("nhr,hvr->nhv", out_latent, w_uv).reshape(len(tokens), -1)  # [n, heads * Dv]
    residual = residual + out @ attn.o_proj.weight.T
    mlp = layer.mlp
    h = rms(residual, layer.post_attention_layernorm.weight, eps)
    residual = residual + (F.silu(h @ mlp.gate_proj.weight.T) * (h @ mlp.up_proj.weight.T)) @ mlp.down_proj.weight.T
    return rms(residual, draft.norm.weight, eps) @ draft.lm_head.weight.T


@pytest.mark.parametrize("flags", [{}, RECIPE], ids=["plain", "recipe"])
def test_mla_draft_step_matches_vllm_latent_attention(flags: dict) -> None:
    draft = mla_draft(**flags)
    aux = torch.randn(6, 3, 32, dtype=torch.float64)
    tokens = torch.randint(0, draft.config.vocab_size, (6,))
    logits, _ = draft.step(DraftKVCache(), draft.combine_aux(aux), tokens)
    # vLLM's rotary runs in float32 (it casts to its cache's dtype): equal to float32 rounding
    torch.testing.assert_close(logits, vllm_reference_logits(draft, aux, tokens), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("steps", [1, 3])
def test_ttt_attention_takes_values_narrower_than_keys(steps: int) -> None:
    torch.manual_seed(1)
    batch, heads, length, dim, v_dim = 2, 4, 9, 10, 5
    document_ids = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, 2], [0, 0, 0, 0, 0, 0, 1, 1, 1]])
    q = torch.randn(batch, heads, length, dim, dtype=torch.float64)
    keys = [torch.randn(batch, heads, length, dim, dtype=torch.float64) for _ in range(steps)]
    values = [torch.randn(batch, heads, length, v_dim, dtype=torch.float64) for _ in range(steps)]
    want = reference_ttt_attention(q, keys, values, document_ids)
    got = ttt_attention_eager(q, keys, values, document_causal_mask(document_ids))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    if steps > 1:  # the flex path's merge of step 0 (with its log-sum-exp) and the diagonal entries
        mask = document_causal_mask(document_ids)
        scores = (q @ keys[0].transpose(-1, -2) * dim**-0.5).masked_fill(~mask, float("-inf"))
        out0, lse0 = scores.softmax(-1) @ values[0], scores.logsumexp(-1)
        merged = merge_diagonal(q, out0, lse0, torch.stack(keys[1:]), torch.stack(values[1:]))
        torch.testing.assert_close(merged, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("q_lora_rank", [10, None], ids=["q-latent", "q-proj"])
def test_mla_decoding_chain_equals_training_unroll(q_lora_rank: int | None) -> None:
    cache = assert_chain_equals_unroll(mla_draft(q_lora_rank, **RECIPE))
    assert cache.keys.shape[-1] == NOPE + ROPE and cache.values.shape[-1] == V_DIM


def test_mla_gradient_layout_covers_every_projection_matrix() -> None:
    """DDP's early gradient sync reduces exactly the layout's matrices: every 2-D weight of the layer."""
    layer = mla_draft().midlayer
    laid_out = {id(p) for params, _ in projection_layout(layer) for p in params}
    matrices = {id(p) for p in layer.parameters() if p.ndim == 2}
    assert laid_out == matrices
    assert set(layer.cast_weights(torch.float64)) == {
        "qkv_embed", "qkv_hidden", "q_b_proj", "kv_b_proj", "o_proj", "gate_up", "down_proj",
    }  # fmt: skip


@pytest.mark.parametrize("q_lora_rank", [10, None], ids=["q-latent", "q-proj"])
def test_mla_export_is_vllms_deepseek_eagle3_layout_and_round_trips(tmp_path, q_lora_rank: int | None) -> None:
    draft = mla_draft(q_lora_rank, **RECIPE).float()
    export_draft(draft, tmp_path, dtype=torch.float32)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and config["model_type"] == "deepseek_v2"
    assert (config["q_lora_rank"], config["kv_lora_rank"], config["qk_nope_head_dim"]) == (q_lora_rank, KV_RANK, NOPE)
    assert (config["qk_rope_head_dim"], config["v_head_dim"]) == (ROPE, V_DIM)
    assert config["fc_norm"] and config["norm_before_residual"] and config["norm_output"]
    tensors = load_file(tmp_path / "model.safetensors")
    attention = sorted(name.removeprefix("midlayer.self_attn.") for name in tensors if ".self_attn." in name)
    q_names = ["q_a_layernorm.weight", "q_a_proj.weight", "q_b_proj.weight"] if q_lora_rank else ["q_proj.weight"]
    assert attention == sorted([*q_names, "kv_a_layernorm.weight", "kv_a_proj_with_mqa.weight", "kv_b_proj.weight",
                                "o_proj.weight"])  # fmt: skip
    assert tensors["midlayer.self_attn.kv_a_proj_with_mqa.weight"].shape == (KV_RANK + ROPE, 64)
    assert tensors["midlayer.self_attn.kv_b_proj.weight"].shape == (HEADS * (NOPE + V_DIM), KV_RANK)
    save_file({**tensors, "embed_tokens.weight": draft.embed_tokens.weight.detach()}, tmp_path / "model.safetensors")
    loaded = load_exported(tmp_path)
    assert loaded.config == replace(draft.config, target_hidden_size=32)  # the export states the width
    aux, ids = torch.randn(5, 3, 32), torch.randint(0, 97, (5,))
    assert torch.equal(
        propose_chain(draft, DraftKVCache(), aux, ids, 3)[0], propose_chain(loaded, DraftKVCache(), aux, ids, 3)[0]
    )


def test_mla_export_states_a_rope_vllm_026_can_build_and_it_is_the_plain_one(tmp_path) -> None:
    """vLLM 0.26's `deepseek_eagle3` layer makes DeepSeek's YaRN of any non-empty `rope_scaling` (under
    transformers 5 the `rope_parameters`) and reads its `factor`: the plain rope of the export before failed
    there with `KeyError: 'factor'` (on the H200). The rope it builds from the export must be the plain one."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    draft = mla_draft().float()
    export_draft(draft, tmp_path, dtype=torch.float32)
    exported = json.loads((tmp_path / "config.json").read_text())
    rope_scaling = dict(exported["rope_parameters"])
    rope_scaling["rope_type"] = "deepseek_yarn"  # what 0.26's layer does with it
    with set_current_vllm_config(VllmConfig()):
        served = get_rope(ROPE, max_position=64, rope_parameters=rope_scaling, is_neox_style=False)
        plain = get_rope(ROPE, max_position=64, rope_parameters={"rope_type": "default",
                         "rope_theta": draft.config.rope_theta}, is_neox_style=False)  # fmt: skip
    assert torch.equal(served.cos_sin_cache[:64], plain.cos_sin_cache[:64])
    assert config_from_hf(exported) == replace(draft.config, target_hidden_size=32)  # and it loads back as trained


def test_mla_export_refuses_a_missing_latent_norm_and_norm_before_fc() -> None:
    draft = mla_draft().float()
    good = checkpoint_tensors(draft)
    with pytest.raises(ValueError, match=r"missing.*kv_a_layernorm"):
        check_checkpoint({k: v for k, v in good.items() if "kv_a_layernorm" not in k}, draft.config)
    with pytest.raises(ValueError, match="norm_before_fc"):
        check_checkpoint(good, replace(draft.config, norm_before_fc=True))


def test_mla_draft_needs_an_mla_target_and_no_input_norm() -> None:
    llama_target = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
                    "vocab_size": 97}  # fmt: skip
    with pytest.raises(ValueError, match="needs an MLA target"):
        DraftConfig.from_target_config(llama_target, 40, [2, 4, 5], "deepseek_mla")
    mla_target = {**llama_target, "model_type": "deepseek_v3", "q_lora_rank": None, "kv_lora_rank": KV_RANK,
                  "qk_nope_head_dim": NOPE, "qk_rope_head_dim": ROPE, "v_head_dim": V_DIM}  # fmt: skip
    shape = DraftConfig.from_target_config(mla_target, 40, [2, 4, 5], "deepseek_mla")
    assert (shape.architecture, shape.q_lora_rank, shape.kv_lora_rank, shape.v_head_dim) == (
        "deepseek_mla", None, KV_RANK, V_DIM,
    )  # fmt: skip
    with pytest.raises(ValidationError, match="norm_before_fc"):
        PipelineConfig.model_validate({"training": {"draft_architecture": "deepseek_mla", "norm_before_fc": True}})
