"""The row layouts users' prompt data comes in, read into one chat form: OpenAI `messages` (roles system,
user, assistant, tool; an assistant's `tool_calls`, a tool message's `tool_call_id`), ShareGPT
`conversations` (`from`/`value`: human, gpt, system, tool), or one `prompt` string; an optional `tools`
column (OpenAI function specs, as a list or its JSON text) goes to the chat template and the engine.

Each function raises ValueError saying what is wrong; the reader adds the file and row.
"""

from __future__ import annotations

import json
from typing import Any

ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "system": "system",
    "tool": "tool",
    "observation": "tool",
}
TOOL_FIELDS = ("tool_call_id", "name")  # a tool message's fields carried to the chat template as given

Message = dict[str, Any]


def text_of(content: Any, where: str) -> str:
    """A message's content as text: a string, or OpenAI's list of text parts (joined by newlines, as vLLM
    joins them for a chat template that takes strings)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in content):
        return "\n".join(p["text"] for p in content)
    raise ValueError(f"{where}.content must be a string or a list of text parts")


def check_tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """OpenAI tool calls: each a `function` with a `name` and `arguments` (a JSON string, or an object)."""
    if not isinstance(calls, list):
        raise ValueError(f"{where}.tool_calls must be a list")
    for i, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValueError(f"{where}.tool_calls[{i}] must have a `function` with a string `name`")
    return calls


def check_message(message: Any, where: str) -> Message:
    """One OpenAI chat message, normalised: text content (None only beside tool calls), tool fields kept."""
    if not isinstance(message, dict):
        raise ValueError(f"{where} must be an object with `role` and `content`")
    role = message.get("role")
    if role not in ROLES:
        raise ValueError(f"{where}.role must be one of {ROLES}, got {role!r}")
    out: Message = {"role": role}
    calls = message.get("tool_calls")
    if role == "assistant" and calls:
        out["content"] = "" if message.get("content") is None else text_of(message["content"], where)
        out["tool_calls"] = check_tool_calls(calls, where)
    else:
        out["content"] = text_of(message.get("content"), where)
    for name in TOOL_FIELDS:
        if isinstance(message.get(name), str):
            out[name] = message[name]
    return out


def check_messages(messages: Any, field: str = "messages") -> list[Message]:
    """A non-empty conversation of OpenAI messages, normalised (`check_message`)."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"`{field}` must be a non-empty list of chat messages")
    checked = [check_message(m, f"{field}[{i}]") for i, m in enumerate(messages)]
    if checked[0]["role"] == "assistant":
        raise ValueError(f"`{field}` starts with the assistant's message: no history precedes it to answer")
    return checked


def sharegpt_messages(turns: Any) -> list[Message]:
    """ShareGPT `conversations` ([{from, value}]) as OpenAI messages."""
    if not isinstance(turns, list) or not turns:
        raise ValueError("`conversations` must be a non-empty list of {from, value}")
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
            raise ValueError(f"conversations[{i}] must be an object with a string `value`")
        role = SHAREGPT_ROLES.get(str(turn.get("from")).lower())
        if role is None:
            raise ValueError(
                f"conversations[{i}].from must be one of {sorted(SHAREGPT_ROLES)}, got {turn.get('from')!r}"
            )
        messages.append({"role": role, "content": turn["value"]})
    return check_messages(messages, "conversations")


def check_tools(tools: Any) -> list[dict[str, Any]]:
    """The `tools` column: OpenAI function specs as a list, or the JSON text of one (Parquet datasets often
    store it so); None or empty means no tools."""
    if tools is None or tools == "":
        return []
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except ValueError as exc:
            raise ValueError(f"`tools` is not JSON: {exc}") from None
    if not isinstance(tools, list):
        raise ValueError("`tools` must be a list of tool specs")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValueError(f"tools[{i}] must be {{type: function, function: {{name, parameters}}}}")
    return tools


def decoded(value: Any) -> Any:
    """A column stored as JSON text (Parquet, Arrow) read back as the list it holds; anything else as is."""
    if isinstance(value, str) and value[:1] in "[{":
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def record_messages(record: dict[str, Any]) -> list[Message]:
    """The conversation of one row, whichever layout it has."""
    if record.get("messages") is not None:
        return check_messages(decoded(record["messages"]))
    if record.get("conversations") is not None:
        return sharegpt_messages(decoded(record["conversations"]))
    if isinstance(record.get("prompt"), str) and record["prompt"].strip():
        return [{"role": "user", "content": record["prompt"]}]
    raise ValueError(
        "needs `messages` (OpenAI chat messages), `conversations` (ShareGPT from/value) or `prompt` (a non-empty "
        "string)"
    )


def record_id(record: dict[str, Any]) -> str | None:
    """The row's own `id`, if it has one."""
    raw = record.get("id")
    if raw is not None and (not isinstance(raw, str | int) or str(raw) == ""):
        raise ValueError(f"`id` must be a non-empty string or integer, got {raw!r}")
    return None if raw is None else str(raw)
