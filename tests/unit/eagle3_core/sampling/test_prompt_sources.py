"""What users' prompt data looks like, read into conversations: ShareGPT and OpenAI (tools, tool calls) rows,
JSONL, JSON arrays, Parquet, `datasets` folders (a Dataset and a DatasetDict), Hub dataset ids from a real
local Hub cache; bad rows named by file and row."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eagle3_core.sampling.prompt_sources import source_digest
from eagle3_core.sampling.prompts import PromptFileError, demo_prompts_path, load_prompts
from tests.helpers.hub_cache import add_commit, use_hub_cache
from tests.helpers.prompt_data import (
    SHAREGPT_ROW,
    TOOL_ROW,
    WEATHER_TOOL,
    save_dict_to_disk,
    save_to_disk,
    write_jsonl,
)


def test_sharegpt_file_becomes_openai_messages(tmp_path):
    (prompt,) = load_prompts([str(write_jsonl(tmp_path / "share.jsonl", [SHAREGPT_ROW]))])
    assert prompt.id == "share-1"
    assert [m["role"] for m in prompt.messages] == ["system", "user", "assistant", "user"]
    assert prompt.messages[2] == {"role": "assistant", "content": "7"}
    assert prompt.tools == []


def test_openai_messages_with_tools_keep_calls_and_tool_results(tmp_path):
    (prompt,) = load_prompts([str(write_jsonl(tmp_path / "tools.jsonl", [TOOL_ROW]))])
    assert prompt.tools == [WEATHER_TOOL]
    call = prompt.messages[1]
    assert call["role"] == "assistant" and call["content"] == ""
    assert call["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert prompt.messages[2] == {"role": "tool", "content": '{"rain": true}', "tool_call_id": "call_1"}
    assert prompt.messages[-1]["role"] == "assistant"  # a conversation ending with the assistant is answered again


def test_tools_change_the_content_id(tmp_path):
    rows = [{"prompt": "weather?"}, {"prompt": "weather?", "tools": json.dumps([WEATHER_TOOL])}]
    plain, with_tools = load_prompts([str(write_jsonl(tmp_path / "p.jsonl", rows))])
    assert plain.id != with_tools.id and with_tools.tools == [WEATHER_TOOL]


def test_json_array_file(tmp_path):
    path = tmp_path / "rows.json"
    path.write_text(json.dumps([SHAREGPT_ROW, {"prompt": "Hello"}], indent=2))
    prompts = load_prompts([str(path)])
    assert [p.messages[-1]["content"] for p in prompts] == ["And one larger than 100?", "Hello"]


def test_parquet_with_conversations_and_tools_as_json_text(tmp_path):
    table = pa.table(
        {
            "conversations": [json.dumps(SHAREGPT_ROW["conversations"])],
            "tools": [json.dumps([WEATHER_TOOL])],
        }
    )
    pq.write_table(table, tmp_path / "p.parquet")
    (prompt,) = load_prompts([str(tmp_path / "p.parquet")])
    assert prompt.messages[1]["content"] == "Name a prime number." and prompt.tools == [WEATHER_TOOL]


def test_datasets_folder_and_dataset_dict(tmp_path):
    rows = [{"id": "a", "conversations": SHAREGPT_ROW["conversations"], "tools": ""}, {"id": "b", "prompt": None,
            "conversations": [{"from": "human", "value": "Hi"}], "tools": json.dumps([WEATHER_TOOL])}]  # fmt: skip
    folder = save_to_disk(tmp_path / "saved", rows)
    a, b = load_prompts([str(folder)])
    assert (a.id, b.id) == ("a", "b")
    assert a.messages[2] == {"role": "assistant", "content": "7"} and b.tools == [WEATHER_TOOL]
    split = save_dict_to_disk(tmp_path / "dict", {"test": [{"prompt": "held"}], "train": [{"prompt": "train me"}]})
    (prompt,) = load_prompts([str(split)])
    assert prompt.messages == [{"role": "user", "content": "train me"}]


def test_bad_row_in_a_datasets_folder_names_file_and_row(tmp_path):
    folder = save_to_disk(tmp_path / "saved", [{"prompt": "fine"}, {"prompt": ""}])
    with pytest.raises(PromptFileError, match=r"saved/data-00000-of-00001\.arrow: row 2: needs `messages`"):
        load_prompts([str(folder)])


def test_bad_rows_of_each_layout_name_file_and_row(tmp_path):
    bad_call = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [{"id": 1}]}]}
    with pytest.raises(PromptFileError, match=r"a\.jsonl:1: messages\[1\]\.tool_calls\[0\] must have a `function`"):
        load_prompts([str(write_jsonl(tmp_path / "a.jsonl", [bad_call]))])
    with pytest.raises(PromptFileError, match=r"b\.jsonl:1: conversations\[0\] must be an object with a string"):
        load_prompts([str(write_jsonl(tmp_path / "b.jsonl", [{"conversations": [{"from": "human"}]}]))])
    with pytest.raises(PromptFileError, match=r"c\.jsonl:1: `tools` is not JSON"):
        load_prompts([str(write_jsonl(tmp_path / "c.jsonl", [{"prompt": "q", "tools": "[{"}]))])
    array = tmp_path / "d.json"
    array.write_text(json.dumps([{"prompt": "ok"}, {"messages": "nope"}]))
    with pytest.raises(PromptFileError, match=r"d\.json: row 2: `messages` must be a non-empty list"):
        load_prompts([str(array)])
    (tmp_path / "empty").mkdir()
    with pytest.raises(PromptFileError, match=r"empty: no prompt data files"):
        load_prompts([str(tmp_path / "empty")])


def test_hub_dataset_id_reads_the_cached_snapshot_offline(tmp_path, monkeypatch):
    data = tmp_path / "repo"
    data.mkdir()
    write_jsonl(data / "train.jsonl", [SHAREGPT_ROW])
    write_jsonl(data / "test.jsonl", [{"prompt": "held out"}])
    (data / "dataset_infos.json").write_text("{}")
    cache = tmp_path / "hub"
    use_hub_cache(monkeypatch, cache)
    add_commit(cache, "org/chats", data, repo_type="dataset")
    (prompt,) = load_prompts(["org/chats"])
    assert prompt.id == "share-1"
    with pytest.raises(PromptFileError, match=r"org/other: neither a prompt file nor a Hub dataset in the local cache"):
        load_prompts(["org/other"])


def test_source_digest_follows_content(tmp_path):
    folder = save_to_disk(tmp_path / "saved", [{"prompt": "a"}])
    before = source_digest(str(folder), demo_prompts_path())
    save_to_disk(folder, [{"prompt": "b"}])
    assert source_digest(str(folder), demo_prompts_path()) != before
    assert source_digest(str(tmp_path / "gone.jsonl"), demo_prompts_path()) == "missing"
