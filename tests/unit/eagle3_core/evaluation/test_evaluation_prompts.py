"""Held-out prompts: HumanEval from the installed package, the SampleSet's held-out split, and the
overlap check that keeps training prompts out of evaluation."""

from __future__ import annotations

from pathlib import Path

import pytest

from eagle3_core.artifacts import SampleSet, record_files
from eagle3_core.evaluation.prompts import (
    EvalPrompt,
    PromptOverlapError,
    check_no_overlap,
    holdout_prompts,
    humaneval_prompts,
    training_prompts,
)
from eagle3_core.sampling.table import is_heldout, row_heldout, sample_id, write_part

FRACTION = 0.25


def make_sample_set(root: Path, questions: list[tuple[str, str]], responses: int = 1) -> SampleSet:
    """One ok row per response of each (prompt id, question), and an error row."""
    rows = [
        {
            "id": sample_id(prompt_id, response),
            "prompt_id": prompt_id,
            "response_index": response,
            "status": "ok",
            "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": question}],
            "response": "answer",
            "input_ids": [1, 2, 3],
            "loss_mask": [0, 1, 1],
        }
        for prompt_id, question in questions
        for response in range(responses)
    ]
    rows.append({"id": "failed", "status": "error", "error": "timeout", "messages": [{"role": "user", "content": "x"}]})
    part = write_part(rows, root / "part-00000.parquet")
    return SampleSet(root=str(root), files=record_files(root, [part]), prompts=len(rows), ok=len(rows) - 1)


def test_humaneval_has_164_prompts_with_the_function_stub() -> None:
    prompts = humaneval_prompts()
    assert len(prompts) == 164
    assert len({p.id for p in prompts}) == 164
    first = prompts[0]
    assert first.id == "HumanEval/0" and first.prompt_set == "humaneval"
    assert "def has_close_elements" in first.chat_messages()[0]["content"]
    assert first.question in first.chat_messages()[0]["content"]
    assert len(humaneval_prompts(max_prompts=5)) == 5


def test_holdout_split_is_the_is_heldout_share_and_disjoint_from_training(tmp_path: Path) -> None:
    questions = [(f"q{i}", f"question number {i}?") for i in range(200)]
    sample_set = make_sample_set(tmp_path, questions)
    heldout = holdout_prompts(sample_set, FRACTION)
    training = training_prompts(sample_set, FRACTION)
    assert {p.id for p in heldout} == {i for i, _ in questions if is_heldout(i, FRACTION)}
    assert 20 < len(heldout) < 80  # a quarter of 200, give or take
    assert len(heldout) + len(training) == 200  # the error row is in neither
    assert not {p.id for p in heldout} & {p.id for p in training}
    assert heldout[0].chat_messages()[0] == {"role": "system", "content": "be brief"}
    assert len(holdout_prompts(sample_set, FRACTION, max_prompts=3)) == 3
    assert check_no_overlap(heldout + humaneval_prompts(10), training) == len(heldout) + 10


def test_overlap_with_training_fails_loudly_naming_the_prompt(tmp_path: Path) -> None:
    questions = [(f"q{i}", f"question number {i}?") for i in range(200)]
    heldout_id = next(i for i, _ in questions if is_heldout(i, FRACTION))
    training_id = next(i for i, _ in questions if not is_heldout(i, FRACTION))
    duplicated = dict(questions)[training_id]
    # The same question (differently spaced) under a held-out id: the classic duplicated prompt file.
    questions = [(i, "  " + duplicated.replace(" ", "\n") if i == heldout_id else q) for i, q in questions]
    sample_set = make_sample_set(tmp_path, questions)
    with pytest.raises(PromptOverlapError, match=rf"holdout:{heldout_id} == training row {training_id}"):
        check_no_overlap(holdout_prompts(sample_set, FRACTION), training_prompts(sample_set, FRACTION))


def test_humaneval_stub_inside_a_training_prompt_is_an_overlap() -> None:
    stub = humaneval_prompts(1)[0]
    leaked = EvalPrompt("t1", "training", (("user", f"Please finish this:\n{stub.question}\nThanks"),))
    with pytest.raises(PromptOverlapError, match="HumanEval/0 is contained in a training prompt"):
        check_no_overlap([stub], [leaked])
    unrelated = EvalPrompt("t2", "training", (("user", "def something_else(): pass"),))
    assert check_no_overlap([stub], [unrelated]) == 1


def test_every_response_of_a_held_out_prompt_is_held_out_and_the_prompt_listed_once(tmp_path: Path) -> None:
    questions = [(f"q{i}", f"question number {i}?") for i in range(200)]
    sample_set = make_sample_set(tmp_path, questions, responses=3)
    heldout = holdout_prompts(sample_set, FRACTION)
    expected = [i for i, _ in questions if is_heldout(i, FRACTION)]
    assert [p.id for p in heldout] == expected, "each held-out prompt once, in the SampleSet's order"
    assert heldout == holdout_prompts(make_sample_set(tmp_path / "one", questions), FRACTION)
    training = training_prompts(sample_set, FRACTION)
    assert len(training) == 3 * (200 - len(expected)) and not {p.id for p in training} & set(expected)
    rows = [{"id": sample_id("q7", r), "prompt_id": "q7"} for r in range(3)]
    assert {row_heldout(row, FRACTION) for row in rows} == {is_heldout("q7", FRACTION)}
    assert check_no_overlap(heldout, training) == len(expected)


def test_multiturn_and_toolcall_sets_are_held_out_rows_asked_with_their_history_and_tools(tmp_path: Path) -> None:
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
    call = {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "x"}'}}
    shapes = {
        "single": ([{"role": "user", "content": "one?"}], []),
        "multi": ([{"role": "user", "content": "a?"}, {"role": "assistant", "content": "A"},
                   {"role": "user", "content": "b?"}], []),
        "tools": ([{"role": "user", "content": "find x"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                   {"role": "tool", "content": "42", "tool_call_id": "c1"}], [tool]),
    }  # fmt: skip
    rows = [
        {"id": f"{shape}-{i}", "status": "ok", "messages": messages, "tools": tools, "response": "r",
         "input_ids": [1], "loss_mask": [1]}
        for shape, (messages, tools) in shapes.items() for i in range(40)
    ]  # fmt: skip
    part = write_part(rows, tmp_path / "part-00000.parquet")
    sample_set = SampleSet(root=str(tmp_path), files=record_files(tmp_path, [part]), prompts=len(rows), ok=len(rows))
    every = holdout_prompts(sample_set, FRACTION)
    multi = holdout_prompts(sample_set, FRACTION, prompt_set="multiturn")
    tools = holdout_prompts(sample_set, FRACTION, prompt_set="toolcall")
    assert multi and tools and {p.id for p in multi} | {p.id for p in tools} < {p.id for p in every}
    assert all(p.id.startswith("multi-") and p.prompt_set == "multiturn" for p in multi)
    assert all(p.id.startswith("tools-") for p in tools)
    asked = tools[0].chat_messages()
    assert asked[1]["tool_calls"] == [call] and asked[2]["tool_call_id"] == "c1" and tools[0].tools() == [tool]
    assert multi[0].tools() == [] and [m["content"] for m in multi[0].chat_messages()] == ["a?", "A", "b?"]
