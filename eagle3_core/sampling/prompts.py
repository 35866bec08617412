"""Prompt sources for sampling: JSONL or Parquet files whose rows hold `messages` (a chat) or `prompt`
(one user turn), with an optional `id`; `demo` names the bundled set.

A prompt's id is what a re-run resumes by, so it must be stable: the file's `id`, else a hash of the
messages. A malformed row fails with its file and line (or row) number before any request is sent.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from eagle3_core.files import sha256_json

DEMO = "demo"
ROLES = ("system", "user", "assistant", "tool")


class PromptFileError(ValueError):
    """A prompt file that cannot be read; the message names the file and the line or row."""


@dataclass(frozen=True)
class Prompt:
    id: str
    messages: list[dict[str, str]]


def demo_prompts_path() -> Path:
    return Path(str(resources.files("eagle3_core") / "data" / "demo_prompts.jsonl"))


def prompt_id(messages: list[dict[str, str]]) -> str:
    """A stable id from content alone, so the same prompt resumes under the same id in every run."""
    return sha256_json(messages)[:16]


def check_messages(messages: Any) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise ValueError("`messages` must be a non-empty list of {role, content}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            raise ValueError(f"messages[{i}] must be an object with a string `content`")
        if message.get("role") not in ROLES:
            raise ValueError(f"messages[{i}].role must be one of {ROLES}, got {message.get('role')!r}")
    if messages[-1]["role"] == "assistant":
        raise ValueError("the last message is the assistant's: nothing is left to sample")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def prompt_from_record(record: Any) -> Prompt:
    """One row (`messages` or `prompt`, optional `id`) -> Prompt; ValueError says what is wrong."""
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    if record.get("messages") is not None:
        messages = check_messages(record["messages"])
    elif isinstance(record.get("prompt"), str) and record["prompt"].strip():
        messages = [{"role": "user", "content": record["prompt"]}]
    else:
        raise ValueError("needs `messages` (a list of chat messages) or `prompt` (a non-empty string)")
    raw_id = record.get("id")
    if raw_id is not None and (not isinstance(raw_id, str | int) or str(raw_id) == ""):
        raise ValueError(f"`id` must be a non-empty string or integer, got {raw_id!r}")
    return Prompt(id=str(raw_id) if raw_id is not None else prompt_id(messages), messages=messages)


def read_jsonl(path: Path) -> Iterator[tuple[str, Prompt]]:
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            where = f"{path}:{number}"
            try:
                line = raw.decode("utf-8")
                if not line.strip():
                    continue
                record = json.loads(line)
            except UnicodeDecodeError as exc:
                raise PromptFileError(f"{where}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
            except (ValueError, RecursionError) as exc:
                raise PromptFileError(f"{where}: not a JSON object: {exc}") from None
            try:
                yield where, prompt_from_record(record)
            except (ValueError, TypeError) as exc:
                raise PromptFileError(f"{where}: {exc}") from None


def read_parquet(path: Path) -> Iterator[tuple[str, Prompt]]:
    import pyarrow.parquet as pq

    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as exc:  # pyarrow raises several unrelated types for a damaged file
        raise PromptFileError(f"{path}: not a readable Parquet file: {exc}") from None
    for number, row in enumerate(rows, start=1):
        where = f"{path}: row {number}"
        try:
            if isinstance(row.get("messages"), str):
                row = {**row, "messages": json.loads(row["messages"])}
            yield where, prompt_from_record(row)
        except (ValueError, TypeError) as exc:
            raise PromptFileError(f"{where}: {exc}") from None


def read_prompt_file(source: str | Path) -> Iterator[tuple[str, Prompt]]:
    """(location, prompt) pairs of one source: `demo`, a .jsonl or a .parquet file."""
    path = demo_prompts_path() if str(source) == DEMO else Path(source).expanduser()
    if not path.is_file():
        raise PromptFileError(f"{path}: prompt file not found")
    if path.suffix == ".parquet":
        return read_parquet(path)
    if path.suffix in (".jsonl", ".json"):
        return read_jsonl(path)
    raise PromptFileError(f"{path}: unknown prompt file type (use .jsonl or .parquet)")


def load_prompts(sources: list[str], max_prompts: int | None = None) -> list[Prompt]:
    """Every prompt of `sources` in order, the first `max_prompts` only. An exact repeat (same id, same
    messages) is kept once; one id naming two different prompts is an error naming both places."""
    prompts: dict[str, Prompt] = {}
    seen_at: dict[str, str] = {}
    for source in sources:
        for where, prompt in read_prompt_file(source):
            if prompt.id in prompts:
                if prompts[prompt.id].messages != prompt.messages:
                    raise PromptFileError(
                        f"{where}: id {prompt.id!r} already names another prompt at {seen_at[prompt.id]}"
                    )
                continue
            prompts[prompt.id] = prompt
            seen_at[prompt.id] = where
            if max_prompts is not None and len(prompts) >= max_prompts:
                return list(prompts.values())
    return list(prompts.values())
