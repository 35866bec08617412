"""The token view of a sampled conversation, for training: `input_ids` of the whole conversation and a
`loss_mask` that is 1 on the target's answers (reasoning and tool calls included), the only tokens a draft
learns.

The prompt part must be exactly the tokens the server fed the target, or the hidden states extracted later
belong to a different sequence. vLLM renders a chat with the tokenizer's chat template to text and
tokenizes that text without adding special tokens; this module does the same. The assistant part is the
template's assistant turn around the generated text (e.g. `<think>…</think>answer<|im_end|>\\n`), so the
end-of-turn tokens the target produces are trained too. Messages and tools reach the template as vLLM hands
them over (`template_messages`), so a tool call is trained as the template renders it at serving time.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SENTINEL = "\u2063EAGLE3_ASSISTANT_CONTENT\u2063"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
Tools = list[dict[str, Any]] | None


@dataclass(frozen=True)
class TokenView:
    input_ids: list[int]
    loss_mask: list[int]
    trained_turns: int = 1  # answers under the loss: fewer than answered where the template rewrote history

    @property
    def prompt_length(self) -> int:
        return self.loss_mask.index(1) if 1 in self.loss_mask else len(self.loss_mask)


def split_reasoning(text: str) -> tuple[str, str]:
    """`<think>r</think>a` -> (r, a); text without a closing tag -> ("", text). Whitespace is kept so
    `join_reasoning` gives back the text the model generated."""
    head, sep, tail = text.partition(THINK_CLOSE)
    if not sep:
        return "", text
    return head.removeprefix(THINK_OPEN), tail


def join_reasoning(reasoning: str, response: str, opened: bool = False) -> str:
    """The assistant's generated text: the reasoning inside think tags, then the response. `opened`: the
    generation prompt already ends with `<think>` (templates that force thinking), so the model wrote
    only the closing tag."""
    if not reasoning:
        return response
    return f"{'' if opened else THINK_OPEN}{reasoning}{THINK_CLOSE}{response}"


def template_arguments(arguments: Any) -> dict[str, Any]:
    """A tool call's arguments as the chat template gets them from vLLM: an object (JSON text parsed; empty,
    malformed or not an object: {})."""
    if isinstance(arguments, dict):
        return arguments
    try:
        parsed = json.loads(arguments) if isinstance(arguments, str) and arguments else None
    except ValueError:
        parsed = None
    return parsed if isinstance(parsed, dict) else {}


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` as vLLM hands them to the chat template: tool-call arguments as objects, no empty
    `tool_calls`, an assistant's `reasoning` also as `reasoning_content` (vLLM 0.32's chat_utils)."""
    out = []
    for message in messages:
        message = copy.deepcopy(message)
        if message["role"] == "assistant" and "tool_calls" in message:
            if not message["tool_calls"]:
                del message["tool_calls"]
            for call in message.get("tool_calls", []):
                call["function"]["arguments"] = template_arguments(call["function"].get("arguments"))
        if message["role"] == "assistant" and message.get("reasoning") is not None:
            message["reasoning_content"] = message["reasoning"]
        out.append(message)
    return out


@dataclass(frozen=True)
class Answer:
    """One assistant turn the target generated: its reasoning, its text and its tool calls (as the engine
    returned them)."""

    reasoning: str = ""
    response: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


class ChatTokenizer:
    """Renders conversations with the target's own tokenizer and chat template."""

    def __init__(self, model_dir: Path | str):
        from transformers import AutoTokenizer

        self.tokenizer: Any = AutoTokenizer.from_pretrained(str(model_dir))

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool, tools: Tools = None) -> str:
        return self.tokenizer.apply_chat_template(
            template_messages(messages),
            tools=tools or None,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prompt_ids(self, messages: list[dict[str, Any]], tools: Tools = None) -> list[int]:
        """The tokens vLLM's chat endpoint feeds the target for `messages` (and `tools`)."""
        return self.encode(self.render(messages, add_generation_prompt=True, tools=tools))

    def assistant_text(
        self, messages: list[dict[str, Any]], generated: str, tools: Tools = None, tool_calls: Tools = None
    ) -> str:
        """The text that follows the rendered prompt when the template renders `generated` (and `tool_calls`)
        as the assistant's reply: found by rendering a sentinel reply and putting the generated text in its
        place, so any text the template writes around a reply (end-of-turn markers, tool calls) is kept. A
        template that renders tool calls in place of the content renders the reply as it is."""
        prompt = self.render(messages, add_generation_prompt=True, tools=tools)
        reply: dict[str, Any] = {"role": "assistant", "content": SENTINEL}
        if tool_calls:
            reply["tool_calls"] = tool_calls
        full = self.render([*messages, reply], add_generation_prompt=False, tools=tools)
        if SENTINEL not in full and tool_calls:  # templates that show tool calls instead of the content
            full = self.render([*messages, {**reply, "content": generated}], add_generation_prompt=False, tools=tools)
            if full.startswith(prompt):
                return full[len(prompt) :]
        if SENTINEL not in full:
            raise ValueError("the chat template does not render the assistant's content")
        before, after = full.split(SENTINEL, 1)
        opener = before[len(prompt) :] if before.startswith(prompt) else ""
        return opener + generated + after

    def answer_text(self, messages: list[dict[str, Any]], answer: Answer, tools: Tools = None) -> tuple[str, str]:
        """(the rendered prompt, the rendered answer after it) of one turn."""
        prompt = self.render(messages, add_generation_prompt=True, tools=tools)
        generated = join_reasoning(answer.reasoning, answer.response, opened=prompt.rstrip().endswith(THINK_OPEN))
        return prompt, self.assistant_text(messages, generated, tools, answer.tool_calls)

    def conversation_view(self, turns: list[tuple[list[dict[str, Any]], Answer]], tools: Tools = None) -> TokenView:
        """The token view of a conversation answered turn by turn: each (history, answer) is one turn, the
        history as served (the earlier answers in it). Each turn's prompt is rendered as served; where it
        extends the text so far, only the new part is added (masked 0) and then the answer (masked 1). A
        template that rewrites earlier turns (e.g. drops their reasoning) breaks that: the view restarts from
        that turn's prompt, so every token is one the target was served."""
        text, ids, mask, trained = "", [], [], 0
        for history, answer in turns:
            prompt, reply = self.answer_text(history, answer, tools)
            if prompt.startswith(text):
                new = self.encode(prompt[len(text) :])
            else:
                ids, mask, new, trained = [], [], self.encode(prompt), 0
            reply_ids = self.encode(reply)
            ids += new + reply_ids
            mask += [0] * len(new) + [1] * len(reply_ids)
            text, trained = prompt + reply, trained + 1
        return TokenView(input_ids=ids, loss_mask=mask, trained_turns=trained)

    def token_view(
        self, messages: list[dict[str, Any]], reasoning: str, response: str, tools: Tools = None
    ) -> TokenView:
        """The token view of one answer to `messages`."""
        return self.conversation_view([(messages, Answer(reasoning, response))], tools)
