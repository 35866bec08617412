"""Measurement (a): chain speculative decoding in transformers is lossless (equals plain greedy, fp32),
counts acceptance per position exactly, and feeds the draft the target's aux states of every verified
position."""

from __future__ import annotations

import pytest
import torch

from eagle3_core.artifacts import TargetModel
from eagle3_core.draft.model import DraftConfig, DraftKVCache
from eagle3_core.evaluation.departures import judge_token_difference
from eagle3_core.evaluation.speculative import (
    eos_token_ids,
    greedy_generate,
    greedy_with_gaps,
    load_target,
    pool_prompt_sets,
    propose_chain,
    render_prompt,
    speculative_generate,
    torch_threads,
)
from eagle3_core.target.models import default_aux_layer_ids
from tests.helpers.drafts import random_batch, tiny_draft
from tests.helpers.evaluation_fixtures import random_draft, varied_tiny_target

MESSAGES = [
    [{"role": "user", "content": "Write a Python function that reverses a string."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}],
]


@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread: on a shared 2-core machine two spinning OpenMP threads stall each other."""
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def tiny(tiny_llama: TargetModel, tmp_path_factory: pytest.TempPathFactory):
    from transformers import AutoTokenizer

    target = varied_tiny_target(tiny_llama, tmp_path_factory.mktemp("varied") / "tiny")
    model = load_target(target.root_path, "float32", torch.device("cpu"))
    return model, AutoTokenizer.from_pretrained(target.root_path), target


class OracleDraft:
    """A stand-in draft that knows the greedy continuation and corrupts chosen positions, so every step's
    accepted count is known in advance. It records what the loop feeds it (states and next tokens)."""

    def __init__(self, layer_ids: list[int], reference: list[int], k: int, seed: int):
        self.config = DraftConfig(8, 8, 1, 1, 8, 1, 1, layer_ids)
        self.reference, self.k = reference, k
        self.rng = torch.Generator().manual_seed(seed)
        self.fed_aux: list[torch.Tensor] = []
        self.fed_ids: list[int] = []
        self.expected_accepts: list[int] = []

    def propose(self, cache: DraftKVCache, aux: torch.Tensor, next_ids: torch.Tensor, num_tokens: int):
        assert num_tokens == self.k and aux.shape[0] == next_ids.shape[0]
        self.fed_aux.append(aux)
        self.fed_ids += next_ids.tolist()
        verified = len(self.fed_ids)  # entry p reads (state p, token p+1) and predicts token p+2
        truth = self.reference[verified + 1 : verified + 1 + num_tokens]
        wrong_at = int(torch.randint(0, num_tokens + 1, (1,), generator=self.rng))
        proposal = [t if i < wrong_at else (t + 1) % 1000 + 3 for i, t in enumerate(truth)]
        self.expected_accepts.append(wrong_at)
        return torch.tensor(proposal), None


def test_propose_returns_target_ids_and_keeps_only_verified_entries() -> None:
    draft = tiny_draft()
    aux, input_ids, _, _ = random_batch(draft, [6])
    cache = DraftKVCache()
    tokens, logits = propose_chain(draft, cache, aux[0], input_ids[0], num_tokens=3)
    assert tokens.shape == (3,) and logits.shape == (3, draft.config.draft_vocab_size)
    assert cache.length == 6
    assert bool(draft.t2d[tokens].all())
    assert torch.equal(tokens[0], draft.draft_to_target(logits[0].argmax()))


def test_oracle_draft_acceptance_is_counted_exactly_and_fed_states_match_a_full_forward(tiny) -> None:
    model, tokenizer, target = tiny
    eos = eos_token_ids(model, tokenizer)
    prompt = render_prompt(tokenizer, MESSAGES[0])
    k, new_tokens = 4, 40
    reference = greedy_generate(model, prompt, new_tokens + k + 2, set())  # long enough for every proposal
    layer_ids = default_aux_layer_ids(target.num_layers)
    oracle = OracleDraft(layer_ids, prompt + reference, k, seed=1)
    result = speculative_generate(model, oracle, prompt, new_tokens, k, set(), propose=OracleDraft.propose)

    assert result.tokens == reference[:new_tokens]
    assert len(set(result.tokens)) > new_tokens // 2  # a varied text, not one token repeated
    assert result.tokens == greedy_generate(model, prompt, new_tokens, eos)[: len(result.tokens)]
    assert result.stats.drafts == len(oracle.expected_accepts)
    expected = [sum(a > i for a in oracle.expected_accepts) for i in range(k)]
    assert result.stats.accepted == expected
    assert expected[0] > 0 and expected[-1] < result.stats.drafts  # both paths were taken

    # The states the draft saw are the target's output_hidden_states at the aux ids, position by position.
    fed = torch.cat(oracle.fed_aux)  # [L, 3, H]
    full = torch.tensor([prompt + result.tokens])
    with torch.no_grad():
        hidden = model(input_ids=full, output_hidden_states=True).hidden_states
    expected_aux = torch.stack([hidden[i][0, : fed.shape[0]] for i in layer_ids], dim=1)
    torch.testing.assert_close(fed, expected_aux, rtol=1e-4, atol=1e-4)
    assert oracle.fed_ids == full[0, 1 : len(oracle.fed_ids) + 1].tolist()


@pytest.mark.parametrize("k", [1, 3, 5])
def test_random_draft_output_equals_greedy(tiny, k: int) -> None:
    model, tokenizer, target = tiny
    draft = random_draft(target)
    eos = eos_token_ids(model, tokenizer)
    for messages in MESSAGES:
        prompt = render_prompt(tokenizer, messages)
        result = speculative_generate(model, draft, prompt, 24, k, eos)
        assert result.tokens == greedy_generate(model, prompt, 24, eos)
        assert result.stats.k == k and result.stats.drafts >= 1
        assert result.timer.seconds["draft"] > 0 and result.timer.seconds["target"] > 0


def test_generation_stops_at_end_of_sequence(tiny) -> None:
    model, tokenizer, target = tiny
    prompt = render_prompt(tokenizer, MESSAGES[1])
    reference = greedy_generate(model, prompt, 30, set())
    stop = reference[5]  # pretend the sixth generated token ends the sequence
    result = speculative_generate(model, random_draft(target), prompt, 30, 3, {stop})
    assert result.tokens == reference[: reference.index(stop) + 1]


def test_greedy_gaps_are_the_top2_logit_gaps_of_each_choice(tiny) -> None:
    model, tokenizer, _ = tiny
    prompt = render_prompt(tokenizer, MESSAGES[0])
    tokens, gaps = greedy_with_gaps(model, prompt, 8, set())
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]  # [8, V]: each choice's
    top2 = logits.topk(2).values  # [8, 2]
    assert tokens == logits.argmax(-1).tolist() and len(gaps) == 8
    assert gaps == pytest.approx((top2[:, 0] - top2[:, 1]).tolist(), abs=1e-3)


def test_a_departure_is_a_near_tie_only_where_plain_greedy_was_a_close_call() -> None:
    plain, gaps = [5, 6, 7, 8], [2.0, 0.01, 3.0, 1.0]
    assert judge_token_difference("p", [5, 9, 1], plain, gaps, 0.05) == {
        "prompt": "p", "token": 1, "gap": 0.01, "near_tie": True
    }  # fmt: skip
    assert not judge_token_difference("p", [5, 6, 9], plain, gaps, 0.05)["near_tie"]  # gap 3.0: a defect
    assert not judge_token_difference("p", [5, 6, 7, 9], plain, gaps, 0.5)["near_tie"]  # 1.0 >= 0.5
    past_end = judge_token_difference("p", [5, 6, 7, 8, 2], plain, gaps, 0.05)
    assert past_end == {"prompt": "p", "token": 4, "gap": None, "near_tie": False}


def test_pooled_lossless_check_counts_near_ties_and_names_defects() -> None:
    from eagle3_core.evaluation.stats import AcceptanceStats

    def measured(identical: str, differences: list[dict]) -> dict:
        stats = AcceptanceStats(3, 4, [2, 1, 0]).to_json()
        return {"acceptance": stats, "tokens": 10, "prompts": 3, "draft_s": 1.0, "target_s": 2.0,
                "identical_to_greedy": identical, "differences": differences}  # fmt: skip

    tie = {"prompt": "a/1", "token": 3, "gap": 0.01, "near_tie": True}
    defect = {"prompt": "b/2", "token": 9, "gap": 4.0, "near_tie": False}
    pooled = pool_prompt_sets({"a": measured("2/3", [tie]), "b": measured("2/3", [defect])})
    assert pooled["identical_to_greedy"] == "4/6"
    assert pooled["near_ties"] == 1 and pooled["defects"] == ["b/2"] and pooled["differences"] == [tie, defect]
