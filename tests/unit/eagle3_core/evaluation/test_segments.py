"""τ per segment of an answer: reasoning, answer, tool call, as measurement (a) and the report give them."""

from __future__ import annotations

from eagle3_core.evaluation.report import segment_lines
from eagle3_core.evaluation.segments import merge_segments, segment_of, segments_from_json, segments_json
from eagle3_core.evaluation.stats import AcceptanceStats


def test_segment_of_the_text_so_far():
    assert segment_of("", opened=False) == "answer"
    assert segment_of("<think>let me", opened=False) == "reasoning"
    assert segment_of("<think>done</think>The", opened=False) == "answer"
    assert segment_of("still thinking", opened=True) == "reasoning"
    assert segment_of("thought</think>Sure", opened=True) == "answer"
    assert segment_of('<think>x</think><tool_call>{"name"', opened=False) == "tool_call"
    assert segment_of("<|tool_calls_section_begin|><|tool_call_begin|>f", opened=False) == "tool_call"


def stats(k: int, steps: list[int]) -> AcceptanceStats:
    out = AcceptanceStats(k)
    for accepted in steps:
        out.add_step(accepted)
    return out


def test_segments_merge_round_trip_and_reach_the_report():
    first = {"reasoning": stats(3, [3, 1]), "answer": stats(3, [0])}
    second = {"answer": stats(3, [2]), "tool_call": stats(3, [3, 3])}
    merged = merge_segments(first, second)
    assert merged["answer"].drafts == 2 and merged["answer"].acceptance_length == 2.0
    saved = segments_json(merged)
    assert saved["tool_call"]["tau"] == 4.0 and saved["reasoning"]["tau"] == 3.0
    assert segments_from_json(saved)["reasoning"].accepted == merged["reasoning"].accepted
    lines = segment_lines({"toolcall": {"segments": saved}, "holdout": {"segments": {}}})
    assert "| toolcall | 3.000 | 2.000 | 4.000 |" in lines and "| holdout | — | — | — |" in lines
    assert segment_lines({"holdout": {}}) == []
