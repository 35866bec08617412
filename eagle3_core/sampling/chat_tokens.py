"""The token view of a sampled conversation, for training: `input_ids` of the whole conversation and a
`loss_mask` that is 1 on the assistant's tokens (reasoning included), the only tokens a draft learns.

The prompt part must be exactly the tokens the server fed the target, or the hidden states extracted later
belong to a different sequence. vLLM renders a chat with the tokenizer's chat template to text and
tokenizes that text without adding special tokens; this module does the same. The assistant part is the
template's assistant turn around the generated text (e.g. `<think>…</think>answer<|im_end|>\\n`), so the
end-of-turn tokens the target produces are trained too.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

SENTINEL = "\u2063EAGLE3_ASSISTANT_CONTENT\u2063"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class TokenView:
    input_ids: list[int]
    loss_mask: list[int]

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


class ChatTokenizer:
    """Renders conversations with the target's own tokenizer and chat template."""

    def __init__(self, model_dir: Path | str):
        from transformers import AutoTokenizer

        self.tokenizer: Any = AutoTokenizer.from_pretrained(str(model_dir))

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """The tokens vLLM's chat endpoint feeds the target for `messages`."""
        return self.encode(self.render(messages, add_generation_prompt=True))

    def assistant_text(self, messages: list[dict[str, str]], generated: str) -> str:
        """The text that follows the rendered prompt when the template renders `generated` as the
        assistant's reply: found by rendering a sentinel reply and putting the generated text in its
        place, so any text the template writes around a reply (end-of-turn markers) is kept."""
        prompt = self.render(messages, add_generation_prompt=True)
        full = self.render([*messages, {"role": "assistant", "content": SENTINEL}], add_generation_prompt=False)
        if SENTINEL not in full:
            raise ValueError("the chat template does not render the assistant's content")
        before, after = full.split(SENTINEL, 1)
        opener = before[len(prompt) :] if before.startswith(prompt) else ""
        return opener + generated + after

    def token_view(self, messages: list[dict[str, str]], reasoning: str, response: str) -> TokenView:
        prompt = self.render(messages, add_generation_prompt=True)
        prompt_ids = self.encode(prompt)
        generated = join_reasoning(reasoning, response, opened=prompt.rstrip().endswith(THINK_OPEN))
        answer_ids = self.encode(self.assistant_text(messages, generated))
        return TokenView(input_ids=prompt_ids + answer_ids, loss_mask=[0] * len(prompt_ids) + [1] * len(answer_ids))
