"""Reasoning capture with vLLM's `kimi_k2` reasoning parser (the one `configs/kimi-k2.5-8gpu.yaml` serves
with), pinned end to end short of the engine: vLLM's own parser splits a generated text, vLLM's own
response objects carry the split to JSON as the server sends it, and `parse_completion` turns that JSON
into the row fields sampling stores. A change in the parser (another split, another field name) fails
here instead of silently dropping reasoning from the training data."""

from __future__ import annotations

import pytest

from eagle3_core.sampling.chat_tokens import join_reasoning
from eagle3_core.sampling.phase import parse_completion


@pytest.fixture(scope="module")
def kimi_parser(smollm2_target):
    from vllm.reasoning import ReasoningParserManager
    from vllm.tokenizers import get_tokenizer

    parser_class = ReasoningParserManager.get_reasoning_parser("kimi_k2")
    return parser_class(get_tokenizer(str(smollm2_target.root_path)))


def served_answer(parser, generated: str, finish_reason: str) -> dict:
    """The JSON body vLLM's chat endpoint answers for `generated`, built with vLLM's protocol classes."""
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionRequest,
        ChatCompletionResponse,
        ChatCompletionResponseChoice,
        ChatMessage,
    )
    from vllm.entrypoints.serve.engine.protocol import UsageInfo

    request = ChatCompletionRequest(model="kimi", messages=[{"role": "user", "content": "Why?"}])
    reasoning, content = parser.extract_reasoning(generated, request)
    message = ChatMessage(role="assistant", reasoning=reasoning, content=content)
    choice = ChatCompletionResponseChoice(index=0, message=message, finish_reason=finish_reason)
    response = ChatCompletionResponse(model="kimi", choices=[choice], usage=UsageInfo(prompt_tokens=3))
    return response.model_dump(mode="json")


def test_a_closed_thought_becomes_reasoning_and_response(kimi_parser):
    answer = served_answer(kimi_parser, "<think>Because the sky scatters blue.</think>It is blue.", "stop")
    message = answer["choices"][0]["message"]
    assert message["reasoning"] == "Because the sky scatters blue." and message["content"] == "It is blue."
    assert "reasoning_content" not in message  # vLLM 0.32 names the field `reasoning`
    fields = parse_completion(answer)
    assert (fields["reasoning"], fields["response"]) == ("Because the sky scatters blue.", "It is blue.")
    assert join_reasoning(fields["reasoning"], fields["response"]) == (
        "<think>Because the sky scatters blue.</think>It is blue."
    )


def test_the_parser_strips_trailing_whitespace_of_the_reasoning(kimi_parser):
    """The training text then differs from the generated one by that whitespace (a known, small loss)."""
    fields = parse_completion(served_answer(kimi_parser, "<think>Step one.\n\n</think>Done.", "stop"))
    assert (fields["reasoning"], fields["response"]) == ("Step one.", "Done.")


def test_a_thought_cut_by_max_tokens_is_all_reasoning(kimi_parser):
    """Kimi thinks first: text without `</think>` (a truncated generation) is reasoning, not the response."""
    fields = parse_completion(served_answer(kimi_parser, "Let me count: one, two", "length"))
    assert (fields["reasoning"], fields["response"], fields["finish_reason"]) == (
        "Let me count: one, two",
        "",
        "length",
    )
