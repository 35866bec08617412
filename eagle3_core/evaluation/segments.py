"""Which part of an answer a speculative step drafts: `reasoning` (inside `<think>…</think>`, or after a
generation prompt that opens it), `tool_call` (after the first tool-call marker a served model writes), or
`answer`. Measurement (a) counts each verification step in the segment of the text emitted before it, so a
report gives τ per segment: agentic traffic is mostly reasoning and tool calls, whose acceptance differs from
prose.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from eagle3_core.evaluation.stats import AcceptanceStats
from eagle3_core.sampling.chat_tokens import THINK_CLOSE, THINK_OPEN

SEGMENTS = ("reasoning", "answer", "tool_call")
# Where a tool call starts in the raw text of vLLM's tool-call parsers' formats (hermes, qwen, kimi_k2,
# mistral, deepseek, llama's python tag).
TOOL_CALL_MARKERS = (
    "<tool_call>",
    "<|tool_calls_section_begin|>",
    "<|tool_call_begin|>",
    "[TOOL_CALLS]",
    "<｜tool▁calls▁begin｜>",
    "<|python_tag|>",
)


def segment_of(text: str, opened: bool) -> str:
    """The segment the next token of an answer whose text so far is `text` belongs to; `opened`: the prompt
    ends with `<think>`, so the answer starts inside the reasoning."""
    if any(marker in text for marker in TOOL_CALL_MARKERS):
        return "tool_call"
    start = 0 if opened else text.find(THINK_OPEN)
    if start >= 0 and THINK_CLOSE not in text[start:]:
        return "reasoning"
    return "answer"


def segmenter(tokenizer: Any, prompt_ids: list[int]) -> Callable[[list[int]], str]:
    """(emitted token ids) -> their segment, for one prompt."""
    opened = tokenizer.decode(prompt_ids[-8:]).rstrip().endswith(THINK_OPEN)
    return lambda tokens: segment_of(tokenizer.decode(tokens), opened)


def segments_json(by_segment: dict[str, AcceptanceStats]) -> dict[str, Any]:
    """Per segment met: its steps' acceptance counts and τ."""
    return {
        name: {"acceptance": stats.to_json(), "tau": stats.acceptance_length}
        for name, stats in by_segment.items()
        if stats.drafts
    }


def merge_segments(into: dict[str, AcceptanceStats], other: dict[str, AcceptanceStats]) -> dict[str, AcceptanceStats]:
    merged = dict(into)
    for name, stats in other.items():
        merged[name] = merged[name].merge(stats) if name in merged else stats
    return merged


def segments_from_json(data: dict[str, Any]) -> dict[str, AcceptanceStats]:
    return {name: AcceptanceStats.from_json(entry["acceptance"]) for name, entry in data.items()}
