"""The draft model: TTT attention against an independent per-query computation, packed documents kept
apart, and the decoding step API agreeing with the training unroll (what vLLM sees is what we train)."""

from __future__ import annotations

import pytest
import torch

from eagle3_core.draft.model import DraftConfig, DraftKVCache, Eagle3Draft
from eagle3_core.training.attention import (
    TTTAttention,
    document_causal_mask,
    merge_diagonal,
    ttt_attention_eager,
)
from tests.helpers.drafts import (
    random_batch,
    reference_ttt_attention,
    seeded_draft,
    tiny_config,
    tiny_draft,
    unroll,
)


@pytest.mark.parametrize("steps", [1, 3])
def test_eager_ttt_attention_matches_reference(steps: int) -> None:
    torch.manual_seed(1)
    batch, heads, kv_heads, length, dim = 2, 4, 2, 9, 8
    document_ids = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, 2], [0, 0, 0, 0, 0, 0, 1, 1, 1]])
    q = torch.randn(batch, heads, length, dim, dtype=torch.float64)
    keys = [torch.randn(batch, kv_heads, length, dim, dtype=torch.float64) for _ in range(steps)]
    values = [torch.randn(batch, kv_heads, length, dim, dtype=torch.float64) for _ in range(steps)]
    got = ttt_attention_eager(q, keys, values, document_causal_mask(document_ids))
    want = reference_ttt_attention(q, keys, values, document_ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_ttt_attention_object_keeps_each_steps_keys() -> None:
    attend = TTTAttention.for_documents(torch.zeros(1, 5, dtype=torch.long), "eager")
    q = torch.randn(1, 2, 5, 4)
    for step in range(3):
        attend(q, torch.randn(1, 1, 5, 4), torch.randn(1, 1, 5, 4))
        assert len(attend.keys) == step + 1
    with pytest.raises(ValueError, match="unknown attention backend"):
        TTTAttention.for_documents(torch.zeros(1, 5, dtype=torch.long), "bogus")


def test_packed_documents_do_not_see_each_other() -> None:
    draft = tiny_draft()
    aux, input_ids, position_ids, document_ids = random_batch(draft, [7, 6])
    packed = unroll(draft, aux, input_ids, position_ids, document_ids, ttt_steps=3)
    alone = unroll(draft, aux[:, 7:], input_ids[:, 7:], position_ids[:, 7:], document_ids[:, 7:] - 1, ttt_steps=3)
    for step in range(3):
        # Index i of the second document at step k is valid while i + k + 2 stays inside it.
        valid = 6 - step - 2
        torch.testing.assert_close(packed[step][:, 7 : 7 + valid], alone[step][:, :valid])


def test_decoding_chain_equals_training_unroll() -> None:
    """The chain vLLM runs (prefix from target states, then own states) is what training scores."""
    draft = tiny_draft()
    steps, length = 3, 10
    aux, input_ids, position_ids, document_ids = random_batch(draft, [length])
    trained = unroll(draft, aux, input_ids, position_ids, document_ids, ttt_steps=steps)
    for start in (0, 4):  # chain after position `start`
        cache = DraftKVCache()
        _, hidden = draft.step(cache, draft.combine_aux(aux[0, : start + 1]), input_ids[0, 1 : start + 2])
        chain = [hidden[-1:]]
        for step in range(1, steps):
            _, hidden = draft.step(cache, chain[-1], input_ids[0, start + step + 1 : start + step + 2])
            chain.append(hidden)
        for step in range(steps):
            torch.testing.assert_close(chain[step][0], trained[step][0, start])
        assert cache.length == start + steps


def test_embeddings_are_frozen_and_names_match_the_checkpoint_layout() -> None:
    draft = tiny_draft()
    trainable = {name for name, p in draft.named_parameters() if p.requires_grad}
    assert "embed_tokens.weight" not in trainable
    assert {
        "fc.weight",
        "midlayer.self_attn.q_proj.weight",
        "midlayer.hidden_norm.weight",
        "norm.weight",
        "lm_head.weight",
    } <= trainable
    assert draft.midlayer.self_attn.q_proj.weight.shape[1] == 2 * draft.config.hidden_size
    assert draft.fc.weight.shape == (32, 96)


def test_lse_merge_used_by_flex_matches_reference() -> None:
    """The GPU path's algebra, on the CPU: step-0 attention (output and log-sum-exp) merged with the
    chain entries equals the per-query reference."""
    torch.manual_seed(3)
    batch, heads, kv_heads, length, dim, steps = 1, 4, 2, 8, 8, 3
    document_ids = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1]])
    q = torch.randn(batch, heads, length, dim, dtype=torch.float64)
    keys = [torch.randn(batch, kv_heads, length, dim, dtype=torch.float64) for _ in range(steps)]
    values = [torch.randn(batch, kv_heads, length, dim, dtype=torch.float64) for _ in range(steps)]
    k0 = keys[0].repeat_interleave(2, 1)
    scores = (q @ k0.transpose(-1, -2) / dim**0.5).masked_fill(~document_causal_mask(document_ids), float("-inf"))
    out0 = torch.softmax(scores, -1) @ values[0].repeat_interleave(2, 1)
    merged = merge_diagonal(q, out0, scores.logsumexp(-1), torch.stack(keys[1:]), torch.stack(values[1:]))
    want = reference_ttt_attention(q, keys, values, document_ids)
    torch.testing.assert_close(merged, want, rtol=1e-5, atol=1e-6)  # the merge computes in fp32


def test_warm_start_keeps_trained_layers_and_rows_of_tokens_in_both_vocabularies():
    """Nightly regeneration warm-starts from yesterday's drafter under a new vocabulary: every layer is
    copied, a kept token keeps its trained lm_head row, a new token keeps the row it was initialised with."""
    from eagle3_core.training.phase import warm_start

    previous, draft = tiny_draft(seed=1), tiny_draft(seed=2)
    initial_rows = draft.lm_head.weight.detach().clone()
    warm_start(draft, previous, "yesterday")
    assert torch.equal(draft.fc.weight, previous.fc.weight)
    assert torch.equal(draft.midlayer.self_attn.o_proj.weight, previous.midlayer.self_attn.o_proj.weight)
    old_targets = previous.draft_to_target(torch.arange(40)).tolist()
    new_targets = draft.draft_to_target(torch.arange(40)).tolist()
    shared = [t for t in new_targets if t in old_targets]
    assert 0 < len(shared) < 40
    for j, token in enumerate(new_targets):
        expected = previous.lm_head.weight[old_targets.index(token)] if token in shared else initial_rows[j]
        assert torch.equal(draft.lm_head.weight[j], expected)
    assert not torch.equal(draft.d2t, previous.d2t)


def test_warm_start_from_a_draft_of_another_shape_is_refused():
    from eagle3_core.training.phase import warm_start

    other = Eagle3Draft(DraftConfig(**{**tiny_config().to_json(), "intermediate_size": 48})).double()
    with pytest.raises(ValueError, match=r"warm start other: tensor midlayer\.mlp"):
        warm_start(tiny_draft(), other, "other")


@pytest.mark.parametrize("architecture", ["llama", "deepseek_mla"])
def test_deferred_weight_gradients_equal_autograds_sum_over_the_steps(architecture: str) -> None:
    """A training unroll sums each projection matrix's TTT-step gradients inside the GEMMs (`deferred_grad`);
    every parameter's gradient equals autograd's own sum over the steps, and validation (no grad) is plain."""
    from tests.helpers.drafts import mla_config

    config = tiny_config() if architecture == "llama" else mla_config()
    draft = seeded_draft(config).double()
    aux, input_ids, position_ids, document_ids = random_batch(draft, [5, 4])
    grads = []
    for defer in (True, False):
        states = unroll(draft, aux, input_ids, position_ids, document_ids, ttt_steps=4, defer=defer)
        loss = sum((draft.compute_logits(state).logsumexp(-1) * (k + 1)).sum() for k, state in enumerate(states))
        params = [p for p in draft.parameters() if p.requires_grad]
        grads.append(torch.autograd.grad(loss, params))
    for deferred, summed in zip(*grads, strict=True):
        torch.testing.assert_close(deferred, summed, rtol=1e-10, atol=1e-12)
    with torch.no_grad():
        assert len(unroll(draft, aux, input_ids, position_ids, document_ids, ttt_steps=2)) == 2
