"""Tiny drafts for unit tests: a seeded random draft (Llama and MLA layouts), a random packed batch, the
training unroll as training gives it attention, the chain-decoding check, and a per-query TTT attention reference."""

from __future__ import annotations

from dataclasses import replace

import torch

from eagle3_core.draft.model import DraftConfig, DraftKVCache, Eagle3Draft
from eagle3_core.training.attention import TTTAttention
from eagle3_core.training.unroll import ttt_states

HEADS, NOPE, ROPE, V_DIM, KV_RANK = 4, 6, 4, 5, 12


def tiny_config(vocab: int = 97, draft_vocab: int = 40) -> DraftConfig:
    return DraftConfig(
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=vocab,
        draft_vocab_size=draft_vocab,
        aux_layer_ids=[2, 4, 5],
        rope_theta=10000.0,
    )


def seeded_draft(config: DraftConfig, seed: int = 0) -> Eagle3Draft:
    """A draft of `config` seeded with `seed`, its draft vocabulary a random sorted subset of the target's."""
    torch.manual_seed(seed)
    draft = Eagle3Draft(config)
    t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
    selected = torch.randperm(config.vocab_size)[: config.draft_vocab_size].sort().values
    t2d[selected] = True
    draft.set_vocab(selected - torch.arange(config.draft_vocab_size), t2d)
    return draft


def tiny_draft(seed: int = 0) -> Eagle3Draft:
    return seeded_draft(tiny_config(), seed).double()


def reference_ttt_attention(q, keys, values, document_ids):
    """Per query: softmax over step-0 keys j <= i of the same document plus index i of steps 1..k."""
    batch, heads, length, dim = q.shape
    groups = heads // keys[0].shape[1]
    out = q.new_zeros(batch, heads, length, values[0].shape[-1])
    for b in range(batch):
        for h in range(heads):
            kv = h // groups
            for i in range(length):
                visible = [j for j in range(i + 1) if document_ids[b, j] == document_ids[b, i]]
                ks = [keys[0][b, kv, j] for j in visible] + [key[b, kv, i] for key in keys[1:]]
                vs = [values[0][b, kv, j] for j in visible] + [value[b, kv, i] for value in values[1:]]
                weights = torch.softmax(torch.stack(ks) @ q[b, h, i] / dim**0.5, dim=0)
                out[b, h, i] = weights @ torch.stack(vs)
    return out


def random_batch(draft: Eagle3Draft, lengths: list[int], seed: int = 2):
    torch.manual_seed(seed)
    total = sum(lengths)
    aux = torch.randn(1, total, 3, draft.config.hidden_size, dtype=torch.float64)
    input_ids = torch.randint(0, draft.config.vocab_size, (1, total))
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    document_ids = torch.cat([torch.full((n,), d) for d, n in enumerate(lengths)])[None]
    return aux, input_ids, position_ids, document_ids


def unroll(
    draft: Eagle3Draft, aux, input_ids, position_ids, document_ids, ttt_steps: int, defer: bool = True
) -> list[torch.Tensor]:
    """The training unroll, with the attention training gives the draft."""
    attend = TTTAttention.for_documents(document_ids)
    return ttt_states(draft, aux, input_ids, position_ids, attend, ttt_steps, defer_weight_gradients=defer)


def assert_chain_equals_unroll(draft: Eagle3Draft, start: int = 4, steps: int = 3) -> DraftKVCache:
    """Decode a chain of `steps` draft tokens after position `start` of a random 10-token sequence through
    the KV cache (prefix from target states, then own states) and check each step's logits against the
    training unroll's (float32 norms: equal to float32 rounding). Returns the cache."""
    aux, input_ids, position_ids, document_ids = random_batch(draft, [10])
    trained = unroll(draft, aux, input_ids, position_ids, document_ids, ttt_steps=steps)
    cache = DraftKVCache()
    logits, hidden = draft.step(cache, draft.combine_aux(aux[0, : start + 1]), input_ids[0, 1 : start + 2])
    chain, hidden = [logits[-1]], hidden[-1:]
    for step in range(1, steps):
        logits, hidden = draft.step(cache, hidden, input_ids[0, start + step + 1 : start + step + 2])
        chain.append(logits[0])
    for step in range(steps):
        want = draft.compute_logits(trained[step][0, start])
        torch.testing.assert_close(chain[step], want, rtol=1e-5, atol=1e-5)
    return cache


def mla_config(q_lora_rank: int | None = 10, **flags: bool) -> DraftConfig:
    return replace(
        tiny_config(),
        architecture="deepseek_mla",
        num_key_value_heads=HEADS,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=KV_RANK,
        qk_nope_head_dim=NOPE,
        qk_rope_head_dim=ROPE,
        v_head_dim=V_DIM,
        **flags,
    )
