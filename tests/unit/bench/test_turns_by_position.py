"""bench/turns_by_position.py's pure parts: the HumanEval conversations and their split, the histories a turn
position is asked with, and τ from vLLM's counters; no engine."""

from __future__ import annotations

from bench.turns_by_position import (
    EXPLAIN_ASK,
    counter_row,
    histories_at,
    markdown,
    request_budget,
    split_rows,
)
from eagle3_core.evaluation.vllm_measure import spec_counters
from eagle3_core.sampling.conversations import turn_positions
from tests.helpers.vllm_metrics import scrape

TASK = {
    "prompt": 'def inc(x):\n    """One more."""\n',
    "canonical_solution": "    return x + 1\n",
    "test": "\ndef check(candidate):\n    assert candidate(1) == 2\n",
}


def test_conversations_end_with_a_user_turn_and_every_fifth_task_is_held_out():
    train, heldout = split_rows([TASK] * 12, every=5)
    assert [r["id"] for r in heldout] == ["humaneval-0", "humaneval-5", "humaneval-10"]
    assert len(train) == 9 and not {r["id"] for r in train} & {r["id"] for r in heldout}
    messages = train[0]["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant", "user"]
    assert (
        TASK["prompt"] in messages[0]["content"]
        and TASK["prompt"] + TASK["canonical_solution"] in messages[1]["content"]
    )
    assert "assert candidate(1) == 2" in messages[3]["content"] and messages[4]["content"] == EXPLAIN_ASK
    assert turn_positions(messages, "all") == [1, 3, 5] and turn_positions(messages, "last") == [5]


def test_served_histories_carry_the_servers_answers_and_given_ones_the_human_turns():
    _, heldout = split_rows([TASK] * 6, every=5)  # humaneval-0 and humaneval-5
    served = {"1": {"answers": {"humaneval-0": "a1"}}, "2": {"answers": {"humaneval-0": "a2"}}}
    first = histories_at(heldout, {}, "served", 0)
    assert {c: [m["role"] for m in h] for c, h in first.items()} == {
        c: ["user"] for c in ("humaneval-0", "humaneval-5")
    }
    third = histories_at(heldout, served, "served", 2)
    assert list(third) == ["humaneval-0"]  # humaneval-5 was not answered at position 1
    assert [m["content"] for m in third["humaneval-0"] if m["role"] == "assistant"] == ["a1", "a2"]
    given = histories_at(heldout, served, "given", 2)
    assert set(given) == {"humaneval-0", "humaneval-5"}
    assert given["humaneval-5"] == heldout[1]["messages"][:5]


def test_request_budget_is_what_the_model_length_leaves():
    assert request_budget(100, 2048, 384) == 384
    assert request_budget(1800, 2048, 384) == 248
    assert request_budget(2048, 2048, 384) == 0


def test_tau_comes_from_the_counters_between_two_scrapes():
    row = counter_row(spec_counters(scrape(10, [5, 2, 1])), spec_counters(scrape(30, [15, 8, 3])))
    assert row == {"tau": 1 + 18 / 20, "drafts": 20, "accepted": [10, 6, 2]}


def test_the_table_pools_positions_and_gives_all_against_last():
    def row(drafts: int, accepted: list[int]) -> dict:
        return {"tau": 1 + sum(accepted) / drafts, "drafts": drafts, "accepted": accepted, "answers": {"c": "x"}}

    served = {
        "last": {"served": {"1": row(10, [5, 0, 0]), "2": row(10, [5, 5, 0])}, "given": {}},
        "all": {"served": {"1": row(10, [10, 0, 0]), "2": row(10, [5, 5, 0])}, "given": {}},
    }
    results = {"machine": "m", "settings": {}, "training": {}, "served": served, "seconds": {}}
    text = markdown(results)
    assert "| last | served | 1.500 (10 drafts; 0.500 / 0.000 / 0.000) | 2.000" in text
    assert "| all / last | served | 1.333x | 1.000x | - | 1.143x |" in text  # overall: 2.0 / 1.75
    assert 'per position: `{"1": 1.0, "2": 1.0}`' in text
