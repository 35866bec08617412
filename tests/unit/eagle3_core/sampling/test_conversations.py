"""`sampling.turns`: conversations answered turn by turn by a scripted server (no vLLM). Under `all` each
answer is the history of the next turn and the row trains on every answer; a run stopped mid-conversation
resumes at its turn; tools go to the engine and the template, tool calls come back into the row."""

from __future__ import annotations

import json
from typing import ClassVar

import pytest

from eagle3_core.config import PipelineConfig
from eagle3_core.events import DECISION, RunEvents
from eagle3_core.sampling import phase as sampling
from eagle3_core.sampling.chat_tokens import Answer, ChatTokenizer
from eagle3_core.sampling.conversations import history_at, turn_positions
from eagle3_core.sampling.table import iter_rows
from eagle3_core.serving.engine import ExternalServer
from tests.helpers.openai_standin import OpenAIStandIn, serving
from tests.helpers.prompt_data import SHAREGPT_ROW, TOOL_ROW, WEATHER_TOOL, write_jsonl
from tests.helpers.tool_template import tool_target

THREE_TURNS = {
    "id": "chat",
    "messages": [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "GIVEN one"},
        {"role": "user", "content": "second"},
        {"role": "assistant", "content": "GIVEN two"},
        {"role": "user", "content": "third"},
    ],
}


class TurnServer(OpenAIStandIn):
    """Answers `A<n>(<user text>|<earlier assistant contents>)`, n counting its answers, so an answer says
    which history it was given; a request whose last user text is in `dead` drops the connection; a request
    with tools calls get_weather."""

    model_id = "turns"
    bodies: ClassVar[list[dict]] = []
    dead: ClassVar[set[str]] = set()

    def do_POST(self):
        body = self.request_body()
        user = [m["content"] for m in body["messages"] if m["role"] == "user"][-1]
        if user in self.dead:
            self.connection.close()
            return
        self.bodies.append(body)
        earlier = ",".join(m["content"] for m in body["messages"] if m["role"] == "assistant")
        message = {"role": "assistant", "content": f"A{len(self.bodies)}({user}|{earlier})"}
        if body.get("tools") and body["messages"][-1]["role"] == "user":
            call = {
                "id": "call_9",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'},
            }
            message = {"role": "assistant", "content": None, "tool_calls": [call]}
        usage = {"prompt_tokens": 10, "completion_tokens": 3}
        self.reply(200, {"choices": [{"message": message, "finish_reason": "stop"}], "usage": usage})


@pytest.fixture
def turn_server():
    TurnServer.bodies, TurnServer.dead = [], set()
    with serving(TurnServer) as url:
        yield ExternalServer(f"{url}/v1")


def config_for(tmp_path, rows, **sampling_fields):
    path = write_jsonl(tmp_path / "prompts.jsonl", rows)
    fields = {
        "prompt_files": [str(path)],
        "retry_backoff_s": 0.01,
        "max_retries": 0,
        "concurrency": 1,
        **sampling_fields,
    }
    return PipelineConfig(
        run_dir=tmp_path / "run", sampling=fields, server={"engine": "external", "max_model_len": 512}
    )


def test_turn_positions_and_histories():
    messages = THREE_TURNS["messages"]
    assert turn_positions(messages, "last") == [5]
    assert turn_positions(messages, "all") == [1, 3, 5]
    assert turn_positions(messages[:4], "last") == [3]
    answers = [Answer("", "mine one"), Answer("", "mine two")]
    assert [m["content"] for m in history_at(messages, [1, 3, 5], answers, 2)] == [
        "first", "mine one", "second", "mine two", "third"]  # fmt: skip


def test_all_turns_are_the_targets_own_in_order(tmp_path, turn_server, smollm2_target):
    config = config_for(tmp_path, [THREE_TURNS], turns="all")
    events = RunEvents(config.run_dir)
    sample_set = sampling.sample_prompts(config, smollm2_target, events, server=turn_server)
    assert sample_set.ok == 1
    sent = [[m["content"] for m in b["messages"]] for b in TurnServer.bodies]
    assert sent == [
        ["first"],
        ["first", "A1(first|)", "second"],
        ["first", "A1(first|)", "second", "A2(second|A1(first|))", "third"],
    ]
    (row,) = iter_rows(sample_set)
    assert row["turns"] == 3 and row["response"] == "A3(third|A1(first|),A2(second|A1(first|)))"
    assert [m["content"] for m in row["messages"]] == sent[-1]
    assert row["completion_tokens"] == 9
    tokens = ChatTokenizer(smollm2_target.root)
    trained = tokens.tokenizer.decode([t for t, m in zip(row["input_ids"], row["loss_mask"], strict=True) if m])
    assert trained == "A1(first|)<|im_end|>\nA2(second|A1(first|))<|im_end|>\n" + row["response"] + "<|im_end|>\n"
    whole = [*row["messages"], {"role": "assistant", "content": row["response"]}]
    assert row["input_ids"] == tokens.encode(tokens.render(whole, add_generation_prompt=False))
    assert any("answers all 3 assistant turns of 1 conversations" in e["message"] for e in events.read())


def test_last_answers_only_the_final_turn_and_a_closing_assistant_turn_is_answered_again(
    tmp_path, turn_server, smollm2_target
):
    closed = {"id": "closed", "messages": [*THREE_TURNS["messages"], {"role": "assistant", "content": "GIVEN 3"}]}
    config = config_for(tmp_path, [closed], turns="last")
    sample_set = sampling.sample_prompts(config, smollm2_target, RunEvents(tmp_path / "run"), server=turn_server)
    (body,) = TurnServer.bodies
    assert [m["content"] for m in body["messages"]] == ["first", "GIVEN one", "second", "GIVEN two", "third"]
    (row,) = iter_rows(sample_set)
    assert row["turns"] == 1 and row["response"] == "A1(third|GIVEN one,GIVEN two)"
    tokens = ChatTokenizer(smollm2_target.root)
    trained = tokens.tokenizer.decode([t for t, m in zip(row["input_ids"], row["loss_mask"], strict=True) if m])
    assert trained == row["response"] + "<|im_end|>\n"


@pytest.mark.parametrize(
    ("rows", "resampled"),
    [([{"id": "q", "messages": [{"role": "user", "content": "only"}]}], 0), ([THREE_TURNS], 3)],
    ids=["single-turn prompts: the rows of last are all's", "a conversation: all answers its 3 turns anew"],
)
def test_the_default_all_reuses_the_rows_of_last_where_they_are_the_same(
    tmp_path, turn_server, smollm2_target, rows, resampled
):
    """Runs sampled at the old default `last` keep their rows under the new default `all` where `all` would
    make the same rows (no prompt has an assistant turn before its last); a conversation is sampled again, and
    its rows of `last` are kept aside, not taken for `all`'s."""
    events = RunEvents(tmp_path / "run")
    sampling.sample_prompts(config_for(tmp_path, rows, turns="last"), smollm2_target, events, server=turn_server)
    asked = len(TurnServer.bodies)
    assert PipelineConfig().sampling.turns == "all"
    sampling.sample_prompts(config_for(tmp_path, rows), smollm2_target, events, server=turn_server)
    assert len(TurnServer.bodies) - asked == resampled


def test_a_grown_prompt_set_samples_only_its_new_prompts_and_an_edited_turn_again(
    tmp_path, turn_server, smollm2_target
):
    """A conversation's row holds the history its last turn was asked with (the target's answers in place of
    the given ones), not the prompt as given: a larger prompt set (the nightly flow's) keeps it, an edited user
    turn samples it again."""
    events = RunEvents(tmp_path / "run")
    sampling.sample_prompts(config_for(tmp_path, [THREE_TURNS]), smollm2_target, events, server=turn_server)
    new = {"id": "new", "messages": [{"role": "user", "content": "fourth"}]}
    sampling.sample_prompts(config_for(tmp_path, [THREE_TURNS, new]), smollm2_target, events, server=turn_server)
    assert len(TurnServer.bodies) == 3 + 1
    edited = {"id": "chat", "messages": [*THREE_TURNS["messages"][:2], {"role": "user", "content": "SECOND"},
                                         *THREE_TURNS["messages"][3:]]}  # fmt: skip
    sampling.sample_prompts(config_for(tmp_path, [edited, new]), smollm2_target, events, server=turn_server)
    assert len(TurnServer.bodies) == 4 + 3


def test_a_run_stopped_mid_conversation_resumes_at_its_turn(tmp_path, turn_server, smollm2_target):
    config = config_for(tmp_path, [THREE_TURNS, SHAREGPT_ROW], turns="all")
    TurnServer.dead = {"third"}
    with pytest.raises(sampling.SamplingAborted, match="unreachable"):
        sampling.sample_prompts(config, smollm2_target, RunEvents(config.run_dir), server=turn_server)
    assert len(TurnServer.bodies) == 2 and (config.run_dir / "samples" / "turns.jsonl").exists()
    TurnServer.dead = set()
    events = RunEvents(config.run_dir)
    sample_set = sampling.sample_prompts(config, smollm2_target, events, server=turn_server)
    assert sample_set.ok == 2
    resumed = [[m["content"] for m in b["messages"]] for b in TurnServer.bodies[2:]]
    assert resumed[0] == ["first", "A1(first|)", "second", "A2(second|A1(first|))", "third"]  # turn 3, not turn 1
    assert len(resumed) == 3  # the chat's last turn, then the ShareGPT row's two
    assert any("2 turns resumed" in e["message"] for e in events.read() if e["event"] == DECISION)
    assert not (config.run_dir / "samples" / "turns.jsonl").exists()
    rows = {r["id"]: r for r in iter_rows(sample_set)}
    assert rows["chat"]["response"] == "A3(third|A1(first|),A2(second|A1(first|)))"


def test_tools_reach_the_engine_and_calls_are_trained_as_the_template_renders_them(
    tmp_path, turn_server, smollm2_target
):
    target = tool_target(smollm2_target, tmp_path / "tool-target")
    config = config_for(tmp_path, [TOOL_ROW], turns="all").model_copy(deep=True)
    config.server.tool_call_parser = "hermes"
    sample_set = sampling.sample_prompts(config, target, RunEvents(config.run_dir), server=turn_server)
    first, second = TurnServer.bodies
    assert first["tools"] == [WEATHER_TOOL] and "tool_choice" not in first
    assert second["messages"][1]["tool_calls"][0]["function"]["arguments"] == '{"city":"Oslo"}'
    assert second["messages"][2] == {"role": "tool", "content": '{"rain": true}', "tool_call_id": "call_1"}
    (row,) = iter_rows(sample_set)
    assert row["tools"] == [WEATHER_TOOL] and row["turns"] == 2
    tokens = ChatTokenizer(target.root)
    text = tokens.tokenizer.decode(row["input_ids"])
    assert '"name": "get_weather"' in text and "You may call these tools" in text
    trained = tokens.tokenizer.decode([t for t, m in zip(row["input_ids"], row["loss_mask"], strict=True) if m])
    assert trained.startswith(
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call><|im_end|>\n'
    )


def test_tools_without_a_parser_are_sent_with_tool_choice_none(tmp_path, turn_server, smollm2_target):
    config = config_for(tmp_path, [{"prompt": "weather?", "tools": [WEATHER_TOOL]}])
    sampling.sample_prompts(config, smollm2_target, RunEvents(config.run_dir), server=turn_server)
    (body,) = TurnServer.bodies
    assert body["tools"] == [WEATHER_TOOL] and body["tool_choice"] == "none"


def test_json_columns_round_trip(tmp_path, turn_server, smollm2_target):
    config = config_for(tmp_path, [{"prompt": "weather?", "tools": json.dumps([WEATHER_TOOL])}])
    sample_set = sampling.sample_prompts(config, smollm2_target, RunEvents(config.run_dir), server=turn_server)
    (row,) = iter_rows(sample_set)
    assert row["tools"] == [WEATHER_TOOL] and row["tool_calls"][0]["function"]["name"] == "get_weather"


class ThinkingServer(TurnServer):
    """TurnServer whose answers come with parsed reasoning."""

    def reply(self, code: int, body: dict) -> None:
        if "choices" in body:
            body["choices"][0]["message"]["reasoning_content"] = "pondering"
        super().reply(code, body)


def test_a_template_that_drops_earlier_reasoning_trains_the_turns_as_served_and_says_so(tmp_path, smollm2_target):
    """SmolLM2's template renders an earlier answer without its reasoning: the last turn was served that
    history, so the row is that turn's prompt and answer, and one decision line says why."""
    ThinkingServer.bodies, ThinkingServer.dead = [], set()
    two_turns = {"id": "chat", "messages": THREE_TURNS["messages"][:3]}
    with serving(ThinkingServer) as url:
        config = config_for(tmp_path, [two_turns], turns="all")
        events = RunEvents(config.run_dir)
        sample_set = sampling.sample_prompts(config, smollm2_target, events, server=ExternalServer(f"{url}/v1"))
    assert ThinkingServer.bodies[1]["messages"][1]["reasoning"] == "pondering"
    (row,) = iter_rows(sample_set)
    tokens = ChatTokenizer(smollm2_target.root)
    trained = tokens.tokenizer.decode([t for t, m in zip(row["input_ids"], row["loss_mask"], strict=True) if m])
    assert trained == "<think>pondering</think>A2(second|A1(first|))<|im_end|>\n"
    assert row["input_ids"][: row["loss_mask"].index(1)] == tokens.prompt_ids(row["messages"])
    assert any(
        e["message"].startswith("1 conversations: the chat template renders earlier turns") for e in events.read()
    )
