"""Where a draft's greedy output departs from plain greedy, judged by the plain run's top-2 log-probability
gap there, whatever the engine (vLLM's OpenAI logprobs, SGLang's `output_top_logprobs`).

On a GPU the verification of k+1 tokens and a one-token decode run differently shaped kernels, so a near-tie
can flip: where two texts first differ, the plain server is asked again for that prompt with its top-2
log-probabilities, and the difference counts as a near-tie when the plain run's top-2 gap there
(log-softmax differences equal logit differences) is below `evaluation.near_tie_logit_gap`. Where that
repeat itself departs from the first plain run, plain greedy does not repeat on this engine (batch-variant
kernels), so there is no fixed reference: those prompts are counted and named apart, as `unrepeatable`.

Such a repeat also measures the engine's own noise: the repeat's top-2 gap where it first left the first plain
run (`flip_gap`) is a decision plain greedy flipped with no draft involved. In bfloat16 that reaches 0.5 (SGLang
0.5.14 on the H200, one logit unit is a few bf16 steps at SmolLM2's logit scale), ten times the float32 bound,
so a draft's departure at a gap no larger than the largest flip of the same run is a near-tie too
(`with_flip_floor`): the engine was seen to decide that close a call either way by itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from eagle3_core.evaluation.prompts import EvalPrompt


@dataclass(frozen=True)
class TokenGap:
    """One generated token: its UTF-8 bytes and the gap between its top-2 log-probabilities."""

    token: bytes
    gap: float


class AsksTop2(Protocol):
    def chat_top2(self, model: str, prompt: EvalPrompt, max_tokens: int) -> tuple[str, list[TokenGap]]:
        """Greedy completion with each generated token's bytes and top-2 log-probability gap."""
        ...


def top2_gap(logprobs: list[float]) -> float:
    """The gap between the two largest log-probabilities; infinite when only one came back."""
    top = sorted(logprobs, reverse=True)
    return top[0] - top[1] if len(top) > 1 else float("inf")


def first_difference(a: str, b: str) -> int | None:
    """The first character index where two texts differ (the shorter one's length if one extends the
    other), or None when they are equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def tokens_at(tokens: list[TokenGap], text: str, char_index: int) -> list[int]:
    """Indices of the tokens where a text departing from `text` (the tokens' concatenation) at `char_index`
    chose another token: the token holding that character, and the one before when the character starts a
    token (the other text may have taken a longer token there, as " then" for " the"). Empty past the end."""
    offset, start = len(text[:char_index].encode()), 0
    for index, token in enumerate(tokens):
        end = start + len(token.token)
        if end > offset:
            return [index - 1, index] if offset == start and index > 0 else [index]
        start = end
    return []


def judge_difference(
    prompt_id: str, texts: tuple[str, str, str], tokens: list[TokenGap], bound: float
) -> dict[str, Any]:
    """Where the draft's text first departs from plain greedy (`texts`: draft, plain, and a repeat of the
    plain request that returned `tokens`): the plain run's token there (the smaller gap of the two candidates
    at a token boundary, `tokens_at`) and its top-2 gap; a near-tie when the gap is below `bound`. Where the
    repeat does not return the plain text again, plain greedy itself is not repeatable: named apart, with the
    gap at which the repeat left the plain text (`flip_gap`), the engine's own noise."""
    draft_text, plain_text, repeat_text = texts
    char = first_difference(draft_text, plain_text)
    index, gap = gap_at(tokens, repeat_text, char)
    repeatable = repeat_text == plain_text
    near_tie = repeatable and gap is not None and gap < bound
    judged = {"prompt": prompt_id, "char": char, "token": index, "gap": gap, "repeatable": repeatable,
              "near_tie": near_tie}  # fmt: skip
    if not repeatable:
        judged["flip_gap"] = gap_at(tokens, repeat_text, first_difference(repeat_text, plain_text))[1]
    return judged


def gap_at(tokens: list[TokenGap], text: str, char: int | None) -> tuple[int | None, float | None]:
    """The token of `text` (the tokens' concatenation) where another text departs at `char`, and its top-2
    gap: the smaller gap of the two candidates at a token boundary (`tokens_at`); (None, None) past the end."""
    candidates = tokens_at(tokens, text, char) if char is not None else []
    index = min(candidates, key=lambda i: tokens[i].gap, default=None)
    return index, tokens[index].gap if index is not None else None


def flip_floor(differences: list[dict[str, Any]]) -> float | None:
    """The largest top-2 gap at which plain greedy flipped by itself in these judged differences (None: it
    repeated everywhere it was asked again)."""
    flips = [d["flip_gap"] for d in differences if d.get("flip_gap") is not None]
    return max(flips, default=None)


def with_flip_floor(differences: list[dict[str, Any]], floor: float | None) -> list[dict[str, Any]]:
    """The differences with a repeatable departure at a gap of at most `floor` counted as a near-tie."""
    if floor is None:
        return differences
    return [
        d | {"near_tie": True} if d.get("repeatable", True) and d.get("gap") is not None and d["gap"] <= floor else d
        for d in differences
    ]


def judge_token_difference(
    prompt_id: str, draft_ids: list[int], plain_ids: list[int], gaps: list[float], bound: float
) -> dict[str, Any]:
    """Where a draft's greedy token ids first depart from plain greedy's (measurement (a), one engine, one
    process, so plain greedy repeats): plain's top-2 logit gap there (`gaps`: one per plain token), and a
    near-tie when it is below `bound`. A departure past plain's last token has no gap: never a near-tie."""
    index = next((i for i, (a, b) in enumerate(zip(draft_ids, plain_ids, strict=False)) if a != b), None)
    index = min(len(draft_ids), len(plain_ids)) if index is None else index
    gap = gaps[index] if index < len(gaps) else None
    return {"prompt": prompt_id, "token": index, "gap": gap, "near_tie": gap is not None and gap < bound}


def judge_outputs(
    client: AsksTop2,
    model: str,
    prompts: list[EvalPrompt],
    outputs: tuple[list[str], list[str]],
    max_tokens: int,
    bound: float,
) -> list[dict[str, Any]]:
    """`judge_difference` for every prompt whose draft output (first) differs from the plain one (second),
    asking the plain server (`client`) again with log-probabilities."""
    judged = []
    for prompt, draft_text, plain_text in zip(prompts, *outputs, strict=True):
        if draft_text != plain_text:
            repeat_text, tokens = client.chat_top2(model, prompt, max_tokens)
            judged.append(judge_difference(prompt.id, (draft_text, plain_text, repeat_text), tokens, bound))
    return judged
