"""Prompt sources for sampling (`prompt_sources`: JSONL, JSON arrays, Parquet, `datasets` folders, Hub
dataset ids), their rows in any layout `prompt_formats` reads (`messages`, `conversations`, `prompt`, and
`tools`), with an optional `id`; `demo` names the bundled set.

A prompt's id is what a re-run resumes by, so it must be stable: the row's `id`, else a hash of the
conversation (and its tools). A malformed row fails with its file and line (or row) number before any
request is sent.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from eagle3_core.files import sha256_json
from eagle3_core.sampling.prompt_formats import Message, check_tools, record_id, record_messages
from eagle3_core.sampling.prompt_sources import PromptFileError, read_source

DEMO = "demo"
__all__ = ["DEMO", "Prompt", "PromptFileError", "load_prompts", "prompt_id"]


@dataclass(frozen=True)
class Prompt:
    """A conversation as given: the last assistant turn (or every one, `sampling.turns: all`) is the
    target's to answer; `tools` go to the chat template and the engine."""

    id: str
    messages: list[Message]
    tools: list[dict[str, Any]] = field(default_factory=list)


def demo_prompts_path() -> Path:
    return Path(str(resources.files("eagle3_core") / "data" / "demo_prompts.jsonl"))


def prompt_id(messages: list[Message], tools: list[dict[str, Any]] | None = None) -> str:
    """A stable id from content alone, so the same prompt resumes under the same id in every run."""
    return sha256_json({"messages": messages, "tools": tools} if tools else messages)[:16]


def prompt_from_record(record: Any) -> Prompt:
    """One row (`messages`, `conversations` or `prompt`; optional `tools`, `id`) -> Prompt; ValueError says
    what is wrong."""
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    messages = record_messages(record)
    tools = check_tools(record.get("tools"))
    return Prompt(id=record_id(record) or prompt_id(messages, tools), messages=messages, tools=tools)


def read_prompts(source: str) -> Iterator[tuple[str, Prompt]]:
    """(location, prompt) of every row of one source."""
    for where, record in read_source(str(source), demo_prompts_path()):
        try:
            prompt = prompt_from_record(record)
        except (ValueError, TypeError) as exc:
            raise PromptFileError(f"{where}: {exc}") from None
        yield where, prompt


def load_prompts(sources: list[str], max_prompts: int | None = None) -> list[Prompt]:
    """Every prompt of `sources` in order, the first `max_prompts` only. An exact repeat (same id, same
    conversation) is kept once; one id naming two different prompts is an error naming both places."""
    prompts: dict[str, Prompt] = {}
    seen_at: dict[str, str] = {}
    for source in sources:
        for where, prompt in read_prompts(source):
            if prompt.id in prompts:
                if prompts[prompt.id] != prompt:
                    raise PromptFileError(
                        f"{where}: id {prompt.id!r} already names another prompt at {seen_at[prompt.id]}"
                    )
                continue
            prompts[prompt.id] = prompt
            seen_at[prompt.id] = where
            if max_prompts is not None and len(prompts) >= max_prompts:
                return list(prompts.values())
    return list(prompts.values())
