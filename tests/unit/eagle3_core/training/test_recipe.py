"""The recipe options of issue 17: the draft flags vLLM's `llama_eagle3` reads (norm_before_fc, fc_norm,
norm_before_residual, norm_output) against an independent formula of vLLM's math, their export names and
round trip, the decoding chain equal to the training unroll under every flag, and the training options
(Muon + AdamW, linear schedule, frozen lm_head, out-of-vocabulary masking)."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from eagle3_core.config import TrainingConfig
from eagle3_core.draft.export import RECIPE_FLAGS, export_draft, load_exported
from eagle3_core.draft.model import DraftKVCache, Eagle3Draft
from eagle3_core.dtypes import resolve_dtype
from eagle3_core.evaluation.speculative import propose_chain
from eagle3_core.events import RunEvents
from eagle3_core.faults import ENV, InjectedFault, faulting_progress
from eagle3_core.progress import ignore_progress
from eagle3_core.training.attention import TTTAttention
from eagle3_core.training.loop import lr_factor, run_training
from eagle3_core.training.loss import TargetHead, TTTObjective
from eagle3_core.training.optimizer import (
    NS_STEPS,
    MuonAdamW,
    NewtonSchulzMuon,
    build_optimizer,
    gram_newton_schulz,
    gram_steps,
    muon_parameters,
    newton_schulz,
    normalized,
    orthogonalize_stacked,
    same_shape_groups,
)
from eagle3_core.training.unroll import ttt_states
from tests.helpers.drafts import assert_chain_equals_unroll, seeded_draft, tiny_config
from tests.helpers.training_data import CPU, synthetic_data

FLAG_SETS = [
    {},
    {"norm_before_fc": True},
    {"fc_norm": True},
    {"norm_before_residual": True},
    {"norm_output": True},
    {flag: True for flag in RECIPE_FLAGS},
]


def flagged_draft(seed: int = 0, **flags: bool) -> Eagle3Draft:
    """The tiny draft with `flags`, every norm weight random (so a norm applied twice or not at all shows)."""
    draft = seeded_draft(replace(tiny_config(), **flags), seed)
    with torch.no_grad():
        for name, param in draft.named_parameters():
            if name.endswith("norm.weight") or ".norm" in name or "fc_norm" in name or name == "input_norm.weight":
                param.uniform_(0.5, 1.5)
    return draft.double()


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def vllm_reference_step(draft: Eagle3Draft, aux: torch.Tensor, token: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """One token at position 0, written from vLLM 0.32's llama_eagle3 (combine_hidden_states, the layer-0
    forward, LlamaModel.forward): returns (logits, state handed to the next step)."""
    c, eps = draft.config, draft.config.rms_norm_eps
    flat = aux.flatten()  # [3 Ht]
    if c.norm_before_fc:
        flat = rms(flat, draft.input_norm.weight, eps)
    if c.fc_norm:
        flat = torch.cat([rms(part, n.weight, eps) for part, n in zip(flat.chunk(3), draft.fc_norm, strict=True)])
    hidden = draft.fc.weight @ flat  # [H]
    layer = draft.midlayer
    embeds = rms(draft.embed_tokens.weight[token], layer.input_layernorm.weight, eps)
    normed_hidden = rms(hidden, layer.hidden_norm.weight, eps)
    residual = normed_hidden if c.norm_before_residual else hidden
    x = torch.cat([embeds, normed_hidden])  # [2H]
    attn = layer.self_attn
    v = attn.v_proj.weight @ x  # one key at one position: attention returns v (per kv head, shared by groups)
    groups = c.num_attention_heads // c.num_key_value_heads
    out = v.view(c.num_key_value_heads, 1, c.head_dim).expand(-1, groups, -1).reshape(-1)
    residual = residual + attn.o_proj.weight @ out
    mlp = layer.mlp
    h = rms(residual, layer.post_attention_layernorm.weight, eps)
    residual = residual + mlp.down_proj.weight @ (F.silu(mlp.gate_proj.weight @ h) * (mlp.up_proj.weight @ h))
    normed = rms(residual, draft.norm.weight, eps)
    return draft.lm_head.weight @ normed, (normed if c.norm_output else residual)


@pytest.mark.parametrize("flags", FLAG_SETS, ids=lambda f: "+".join(f) or "none")
def test_draft_step_matches_vllm_math(flags: dict) -> None:
    draft = flagged_draft(**flags)
    aux = torch.randn(3, 32, dtype=torch.float64) * torch.tensor([[1.0], [20.0], [300.0]], dtype=torch.float64)
    token = torch.tensor([5])
    logits, state = draft.step(DraftKVCache(), draft.combine_aux(aux[None]), token)
    want_logits, want_state = vllm_reference_step(draft, aux, token[0])
    # RMSNorm computes in float32 (as vLLM's does), so float64 agrees to float32 rounding
    torch.testing.assert_close(logits[0], want_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state[0], want_state, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("flags", FLAG_SETS[1:], ids=lambda f: "+".join(f))
def test_decoding_chain_equals_training_unroll_under_each_flag(flags: dict) -> None:
    assert_chain_equals_unroll(flagged_draft(**flags))


@pytest.mark.parametrize("flags", FLAG_SETS[1:], ids=lambda f: "+".join(f))
def test_export_carries_flags_and_norm_weights(tmp_path: Path, flags: dict) -> None:
    draft = flagged_draft(**flags).float()
    export_draft(draft, tmp_path, dtype=torch.float32)
    config = json.loads((tmp_path / "config.json").read_text())
    assert {flag: config[flag] for flag in RECIPE_FLAGS} == {flag: flags.get(flag, False) for flag in RECIPE_FLAGS}
    tensors = load_file(tmp_path / "model.safetensors")
    assert ("input_norm.weight" in tensors) == bool(flags.get("norm_before_fc"))
    assert ("fc_norm.0.weight" in tensors) == bool(flags.get("fc_norm"))
    if flags.get("norm_before_fc"):
        assert tensors["input_norm.weight"].shape == (96,)
    if flags.get("fc_norm"):
        assert sorted(n for n in tensors if n.startswith("fc_norm")) == [f"fc_norm.{i}.weight" for i in range(3)]
    save_file({**tensors, "embed_tokens.weight": draft.embed_tokens.weight.detach()}, tmp_path / "model.safetensors")
    loaded = load_exported(tmp_path)
    assert all(getattr(loaded.config, flag) == getattr(draft.config, flag) for flag in RECIPE_FLAGS)
    for name, tensor in draft.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    aux, ids = torch.randn(5, 3, 32), torch.randint(0, 97, (5,))
    assert torch.equal(
        propose_chain(draft, DraftKVCache(), aux, ids, 3)[0], propose_chain(loaded, DraftKVCache(), aux, ids, 3)[0]
    )


def test_linear_schedule_decays_to_the_floor() -> None:
    assert lr_factor(0, 100, 0.01, 0.0, "linear") == 1.0
    assert lr_factor(50, 100, 0.0, 0.0, "linear") == pytest.approx(0.5)
    assert lr_factor(100, 100, 0.0, 0.0, "linear") == 0.0
    assert lr_factor(50, 100, 0.0, 0.1, "cosine") == pytest.approx(0.55)
    assert lr_factor(75, 100, 0.0, 0.0, "cosine") == pytest.approx(0.5 * (1 + math.cos(0.75 * math.pi)))


def objective_and_head(**flags) -> tuple[TTTObjective, TargetHead]:
    draft = flagged_draft(**flags).float()
    generator = torch.Generator().manual_seed(9)
    head = TargetHead(
        weight=torch.randn(40, 32, generator=generator), norm_weight=torch.ones(32), eps=1e-5, d2t=draft.d2t
    )
    head.full_weight = torch.randn(97, 32, generator=generator)
    head.weight = head.full_weight[draft.t2d].contiguous()
    head.t2d = draft.t2d.clone()
    return TTTObjective(draft, ttt_steps=2, step_weight=1.0, attention="eager"), head


def test_muon_takes_the_2d_weights_but_lm_head_and_resumes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    objective, head = objective_and_head(norm_before_fc=True)
    muon, adamw = muon_parameters(objective)
    names = {id(p): n for n, p in objective.named_parameters()}
    assert {names[id(p)] for p in adamw} >= {"draft.lm_head.weight", "draft.norm.weight", "draft.input_norm.weight"}
    assert all(p.ndim == 2 for p in muon) and "draft.fc.weight" in {names[id(p)] for p in muon}
    tc = TrainingConfig(optimizer="muon", lr=1e-2, weight_decay=0.01, max_steps=6, checkpoint_every=3, batch_size=2)
    assert isinstance(build_optimizer(objective, tc, torch.device("cpu")), MuonAdamW)
    data = synthetic_data(6)
    run_training(objective, head, data, None, tc, tmp_path / "straight", CPU, RunEvents(tmp_path))
    straight = {k: v.clone() for k, v in objective.state_dict().items()}
    objective, head = objective_and_head(norm_before_fc=True)
    monkeypatch.setenv(ENV, "training:steps=5")  # the run dies after its checkpoint at step 3
    with pytest.raises(InjectedFault):
        crashing = faulting_progress("training", ignore_progress)
        run_training(objective, head, data, None, tc, tmp_path / "resumed", CPU, RunEvents(tmp_path), crashing, 0.0)
    monkeypatch.delenv(ENV)
    objective, head = objective_and_head(norm_before_fc=True)
    run_training(objective, head, data, None, tc, tmp_path / "resumed", CPU, RunEvents(tmp_path))
    for name, tensor in objective.state_dict().items():
        assert torch.equal(tensor, straight[name]), name
    assert not torch.equal(straight["draft.fc.weight"], objective_and_head(norm_before_fc=True)[0].draft.fc.weight)


def batch_of(objective: TTTObjective) -> dict[str, torch.Tensor]:
    item = synthetic_data(1, seed=3)[0]
    return {name: tensor[None] for name, tensor in item.items()}


def test_frozen_lm_head_gets_no_gradient_and_the_rest_trains() -> None:
    objective, head = objective_and_head()
    objective.draft.lm_head.weight.requires_grad_(False)
    loss, _, _, _ = objective(batch_of(objective), head)
    loss.backward()
    assert objective.draft.lm_head.weight.grad is None and objective.draft.fc.weight.grad is not None


def test_mask_leaves_out_positions_whose_target_argmax_is_outside_the_draft_vocab() -> None:
    objective, head = objective_and_head()
    batch = batch_of(objective)
    plain_loss, plain_stats, _, valid = objective(batch, head)
    objective.mask_out_of_vocab = True
    loss, stats, _, _ = objective(batch, head)
    assert torch.equal(stats[:, 1:], plain_stats[:, 1:])  # top-1 and counts still over every scored row
    inside = head.in_draft_vocab(head.full_top1(batch["last"]))[0]  # [T]
    assert 0 < int(inside.sum()) < len(inside)
    attend = TTTAttention.for_documents(batch["document_ids"], "auto")
    states = ttt_states(objective.draft, batch["aux"], batch["input_ids"], batch["position_ids"], attend, 2)
    target_logits = head.logits(batch["last"])[0]
    want = 0.0
    for step in range(2):
        rows = [i for i in valid[step, 0].nonzero().flatten().tolist() if inside[i + step + 1]]
        logits = objective.draft.compute_logits(states[step][0, rows])
        targets = torch.softmax(target_logits[[i + step + 1 for i in rows]], -1)
        want = want + -(targets * torch.log_softmax(logits, -1)).sum(-1).mean()
    torch.testing.assert_close(loss, want.detach())
    assert not torch.isclose(loss, plain_loss)


def test_newton_schulz_muon_is_torchs_muon_in_bf16_and_close_to_it_in_fp32() -> None:
    """Our Muon runs torch's update; only the dtype of the orthogonalisation is the device's (fp32 on a
    CPU without bf16 units, where torch's bf16 iteration is emulated ~10x slower). Same-shape matrices (also
    transposed ones: [48, 80] and [80, 48]) are orthogonalised as one stack, bit for bit torch's; long ones
    ([96, 32], [32, 96]: n = 3m) through the Gram form, equal up to bf16 rounding."""
    torch.manual_seed(0)
    start = [torch.randn(48, 80), torch.randn(96, 32), torch.randn(80, 48), torch.randn(48, 80), torch.randn(32, 96)]
    assert same_shape_groups(start) == [[0, 2, 3], [1, 4]]
    grads = [[torch.randn_like(w) for w in start] for _ in range(3)]

    def trained(make) -> list[torch.Tensor]:
        weights = [torch.nn.Parameter(w.clone()) for w in start]
        optimizer = make(weights)
        for step_grads in grads:
            for weight, grad in zip(weights, step_grads, strict=True):
                weight.grad = grad.clone()
            optimizer.step()
        return [w.detach() for w in weights]

    reference = trained(lambda ws: torch.optim.Muon(ws, lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw"))
    bf16 = trained(lambda ws: NewtonSchulzMuon(ws, lr=0.02, weight_decay=0.1, ns_dtype=torch.bfloat16))
    fp32 = trained(lambda ws: NewtonSchulzMuon(ws, lr=0.02, weight_decay=0.1, ns_dtype=torch.float32))
    for index, (want, same, close, initial) in enumerate(zip(reference, bf16, fp32, start, strict=True)):
        moved, moved_bf16, moved_fp32 = want - initial, same - initial, close - initial
        if index in (1, 4):  # the Gram form
            assert F.cosine_similarity(moved.flatten(), moved_bf16.flatten(), dim=0) > 0.999
        else:
            assert torch.equal(same, want)
        assert F.cosine_similarity(moved.flatten(), moved_fp32.flatten(), dim=0) > 0.99
    layers = torch.nn.Sequential(torch.nn.Linear(8, 8, bias=False), torch.nn.LayerNorm(8))  # Muon and AdamW parts
    cpu = build_optimizer(layers, TrainingConfig(optimizer="muon"), torch.device("cpu"))
    assert cpu.muon.ns_dtype == getattr(torch, resolve_dtype("auto", False))


def test_gram_newton_schulz_is_the_same_polynomial() -> None:
    """The Gram form computes the standard iteration's result (float64: equal to rounding), and in float32
    too, for a square-ish, a long and a rank-deficient stack."""
    generator = torch.Generator().manual_seed(4)
    long = torch.randn(3, 16, 64, generator=generator, dtype=torch.float64)
    low_rank = torch.randn(2, 16, 2, generator=generator, dtype=torch.float64) @ long[:2, :2]
    for stacked in (torch.randn(2, 24, 32, generator=generator, dtype=torch.float64), long, low_rank):
        want = newton_schulz(stacked)
        torch.testing.assert_close(gram_newton_schulz(stacked), want, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(gram_newton_schulz(stacked.float()), want.float(), rtol=1e-4, atol=1e-5)
    assert torch.equal(orthogonalize_stacked(long), gram_newton_schulz(long))  # n >= 3m: the Gram form
    assert torch.equal(orthogonalize_stacked(long[:, :, :40]), newton_schulz(long[:, :, :40]))


def test_gram_newton_schulz_keeps_bf16_rounding_near_the_standard_forms() -> None:
    """A gradient with one dominant direction: unrestarted, the Gram form's bf16 rounding of R grows with
    the small singular values (error > 1); restarted after two steps it stays near the standard form's (as on
    gaussian matrices: within 3x here, 1.1x at the draft's 4096 x 14336 on the GPU)."""
    generator = torch.Generator().manual_seed(5)
    noise = torch.randn(2, 64, 224, generator=generator)
    spike = torch.randn(2, 64, 1, generator=generator) @ noise[:, :1] * 30 + noise
    forms = {
        "standard": newton_schulz,
        "gram": gram_newton_schulz,
        "unrestarted": lambda x: gram_steps(normalized(x), NS_STEPS),
    }
    for stacked in (noise, spike):
        want = newton_schulz(stacked.double())
        error = {
            name: float((fn(stacked.bfloat16()).double() - want).norm() / want.norm()) for name, fn in forms.items()
        }
        assert error["gram"] < 3 * error["standard"]
    assert error["unrestarted"] > 1 > 1.5 * error["standard"] > error["gram"]
