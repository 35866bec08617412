"""Conversations answered by the target turn by turn (`sampling.turns`).

`last`: the target answers the conversation's last assistant turn (the one after its last message, or the
last assistant message itself, which is answered again); earlier assistant turns stay as given. `all`: the
conversation is replayed: each assistant turn is the target's own answer to the history so far, and that
answer, not the given one, is the history of the next turn. User, system and tool messages are kept as given.

A turn's answer is recorded in the `TurnLog` as soon as it arrives, so a conversation interrupted by a crash
resumes at the turn it stopped at (keyed by sample id and turn).
"""

from __future__ import annotations

import json
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from eagle3_core.sampling.chat_tokens import Answer
from eagle3_core.sampling.prompt_formats import Message

Turns = Literal["last", "all"]
LOG_FILE = "turns.jsonl"


def turn_positions(messages: list[Message], turns: Turns) -> list[int]:
    """The indices in `messages` where the target answers: an assistant message there is replaced, an index
    equal to len(messages) appends the answer."""
    end = [] if messages[-1]["role"] == "assistant" else [len(messages)]
    if turns == "last":
        return end or [len(messages) - 1]
    return [i for i, m in enumerate(messages) if m["role"] == "assistant"] + end


def answers_several_turns(messages: list[Message]) -> bool:
    """Whether `sampling.turns` matters to this conversation: `all` answers more turns of it than `last`."""
    return len(turn_positions(messages, "all")) > 1


def asked_for(messages: list[Message], turns: Turns) -> list[Message]:
    """What a conversation's row depends on: the messages before its last answered turn, of which `all` keeps
    only those it does not answer itself (a row holds the history its last turn was asked with: under `all`,
    the target's answers in the given assistant turns' places)."""
    asked = messages[: turn_positions(messages, turns)[-1]]
    return [m for m in asked if m["role"] != "assistant"] if turns == "all" else asked


def answer_message(answer: Answer) -> Message:
    """The target's answer as the next turn's history holds it, as a client sends an answer back: its text,
    its tool calls, and its reasoning (vLLM's field for interleaved thinking)."""
    message: Message = {"role": "assistant", "content": answer.response}
    if answer.tool_calls:
        message["tool_calls"] = answer.tool_calls
    if answer.reasoning:
        message["reasoning"] = answer.reasoning
    return message


def history_at(messages: list[Message], positions: list[int], answers: list[Answer], turn: int) -> list[Message]:
    """The history turn `turn` is asked with: the given messages before its position, the assistant messages
    at earlier answered positions replaced by the target's answers."""
    replaced = {positions[t]: answer_message(answers[t]) for t in range(turn)}
    return [replaced.get(i, m) for i, m in enumerate(messages[: positions[turn]])]


def turns_decision(work: list[Any], done: dict[str, list[dict[str, Any]]]) -> str:
    """The events line of `sampling.turns: all` for `work` (items with `prompt.messages` and `sample_id`)."""
    total = sum(len(turn_positions(w.prompt.messages, "all")) for w in work)
    resumed = sum(min(len(done.get(w.sample_id, [])), len(turn_positions(w.prompt.messages, "all"))) for w in work)
    return (
        f"sampling.turns all: the target answers all {total} assistant turns of {len(work)} conversations in "
        f"order, each answer the history of the next; {resumed} turns resumed from {LOG_FILE}"
    )


def answer_of(fields: dict[str, Any]) -> Answer:
    """The answer in a completion's row fields (`phase.parse_completion`)."""
    return Answer(fields["reasoning"], fields["response"], fields.get("tool_calls") or [])


class TurnLog:
    """Answers of unfinished conversations, one JSON line per turn (its row fields) in
    `<samples>/turns.jsonl`. Lines of another run key (`key`: a digest of the rows' key) are ignored; a torn
    last line (a crash mid-write) too."""

    def __init__(self, folder: Path, key: str):
        self.path = folder / LOG_FILE
        self.key = key

    def load(self) -> dict[str, list[dict[str, Any]]]:
        """Sample id -> the row fields of its first turns, in order."""
        done: dict[str, list[dict[str, Any]]] = {}
        if not self.path.exists():
            return done
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            turns = done.setdefault(entry["id"], []) if entry.get("key") == self.key else None
            if turns is not None and entry["turn"] == len(turns):
                turns.append(entry["fields"])
        return done

    def record(self, sample_id: str, turn: int, fields: dict[str, Any]) -> None:
        line = json.dumps({"key": self.key, "id": sample_id, "turn": turn, "fields": fields}, ensure_ascii=False)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())

    def clear(self) -> None:
        self.path.unlink(missing_ok=True)


@dataclass
class TurnResult:
    """What the request for one turn gave: its row fields, or why there are none (`skip`: the history is too
    long for the model; `error`: the request failed)."""

    fields: dict[str, Any] | None = None
    skip: str | None = None
    error: str | None = None


Ask = Callable[[list[Message], int], Awaitable[TurnResult]]  # (history, turn) -> result


@dataclass
class Replay:
    """A conversation answered: each turn's (history, answer), the row fields of the last answer (completion
    tokens summed over the turns), or the reason it has none (skipped or failed at its first turn left)."""

    turns: list[tuple[list[Message], Answer]]
    fields: dict[str, Any]
    skip: str | None = None
    error: str | None = None


async def replay(
    messages: list[Message],
    turns: Turns,
    done: list[dict[str, Any]],
    ask: Ask,
    record: Callable[[int, dict[str, Any]], None],
) -> Replay:
    """Answer the turns of `messages` not in `done` (row fields of its first turns) in order, `record`ing
    each. A turn too long for the model ends the conversation at the turns before it (skipped if it is the
    first); a failed request ends it with the error (the turns before it stay in the log for a re-run)."""
    positions = turn_positions(messages, turns)
    made = list(done[: len(positions)])
    for turn in range(len(made), len(positions)):
        history = history_at(messages, positions, [answer_of(f) for f in made], turn)
        result = await ask(history, turn)
        if result.error is not None or (result.skip is not None and not made):
            return Replay([], {}, result.skip, result.error)
        if result.fields is None:
            break
        made.append(result.fields)
        record(turn, result.fields)
    answers = [answer_of(f) for f in made]
    pairs = [(history_at(messages, positions, answers, t), a) for t, a in enumerate(answers)]
    completion = sum(f.get("completion_tokens", 0) for f in made)
    return Replay(pairs, {**made[-1], "completion_tokens": completion})
