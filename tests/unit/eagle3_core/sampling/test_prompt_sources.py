"""What users' prompt data looks like, read into conversations: ShareGPT and OpenAI (tools, tool calls) rows,
JSONL, JSON arrays, Parquet, folders written by `datasets` (a Dataset and a DatasetDict), Hub dataset ids
offline from `datasets`' own cache and from a real huggingface_hub cache; bad rows named by file (or folder or
Hub id and split) and row."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eagle3_core.files import sha256_json
from eagle3_core.sampling.prompt_sources import source_digest
from eagle3_core.sampling.prompts import PromptFileError, demo_prompts_path, load_prompts
from tests.helpers.hub_cache import add_commit, commit_sha, use_hub_cache
from tests.helpers.prompt_data import (
    SHAREGPT_ROW,
    TOOL_ROW,
    WEATHER_TOOL,
    prepare_as_loaded,
    save_dict_to_disk,
    save_to_disk,
    use_datasets_cache,
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
    (prompt,) = load_prompts([str(split / "test")])  # a split's folder names the split
    assert prompt.messages == [{"role": "user", "content": "held"}]


def test_datasets_folder_saved_with_a_format_reads_python_rows(tmp_path):
    from datasets import Dataset

    Dataset.from_list([{"prompt": "q", "turns": 1}]).with_format("numpy").save_to_disk(str(tmp_path / "np"))
    (prompt,) = load_prompts([str(tmp_path / "np")])
    assert prompt.messages == [{"role": "user", "content": "q"}]


def test_dataset_dict_without_train_asks_for_a_split(tmp_path):
    folder = save_dict_to_disk(tmp_path / "dict", {"test": [{"prompt": "a"}], "validation": [{"prompt": "b"}]})
    with pytest.raises(PromptFileError, match=r"dict: splits \['test', 'validation'\] and none is `train`"):
        load_prompts([str(folder)])


def test_bad_row_in_a_datasets_folder_names_folder_split_and_row(tmp_path):
    folder = save_to_disk(tmp_path / "saved", [{"prompt": "fine"}, {"prompt": ""}])
    with pytest.raises(PromptFileError, match=r"saved: row 2: needs `messages`"):
        load_prompts([str(folder)])
    split = save_dict_to_disk(tmp_path / "dict", {"train": [{"prompt": "fine"}, {"prompt": ""}]})
    with pytest.raises(PromptFileError, match=r"dict\[train\]: row 2: needs `messages`"):
        load_prompts([str(split)])


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


def chats_repo(folder, rows):
    """A dataset repo's files: a train and a test split as JSONL, of the same columns (`datasets` wants that);
    the test split holds each row twice, so a read of it would show in the count."""
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", rows)
    write_jsonl(folder / "test.jsonl", rows + rows)
    return folder


def test_hub_dataset_id_offline_from_the_datasets_cache_of_a_load(tmp_path, monkeypatch):
    use_hub_cache(monkeypatch, tmp_path / "hub")  # huggingface_hub's cache holds nothing
    use_datasets_cache(monkeypatch, tmp_path / "datasets")
    commit = commit_sha("org/chats", None)
    prepare_as_loaded(tmp_path / "datasets", "org/chats", commit, chats_repo(tmp_path / "chats", [SHAREGPT_ROW]))
    (prompt,) = load_prompts(["org/chats"])
    assert prompt.id == "share-1"
    assert source_digest("org/chats", demo_prompts_path()) == sha256_json(["org/chats", commit, ["train"]])
    prepare_as_loaded(tmp_path / "datasets", "org/bad", commit, chats_repo(tmp_path / "bad", [{"n": 1}]))
    with pytest.raises(PromptFileError, match=r"org/bad\[train\]: row 1: needs `messages`"):
        load_prompts(["org/bad"])


def test_hub_dataset_id_offline_from_a_downloaded_snapshot(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    use_hub_cache(monkeypatch, cache)
    use_datasets_cache(monkeypatch, tmp_path / "datasets")  # `datasets` never prepared it
    add_commit(cache, "org/chats", chats_repo(tmp_path / "repo", [SHAREGPT_ROW]), repo_type="dataset")
    (prompt,) = load_prompts(["org/chats"])
    assert prompt.id == "share-1"
    with pytest.raises(PromptFileError) as error:
        load_prompts(["org/other"])
    assert str(error.value).startswith("org/other: neither a prompt file nor a Hub dataset in the local caches")
    assert str(tmp_path / "datasets") in str(error.value) and "\n" not in str(error.value)


def test_pinned_revision_offline_is_read_from_its_snapshot_where_datasets_holds_another(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    use_hub_cache(monkeypatch, cache)
    use_datasets_cache(monkeypatch, tmp_path / "datasets")
    old = add_commit(cache, "org/chats", chats_repo(tmp_path / "old", [{"prompt": "old"}]), repo_type="dataset")
    new_repo = chats_repo(tmp_path / "new", [{"prompt": "new"}])
    new = add_commit(cache, "org/chats", new_repo, repo_type="dataset")
    prepare_as_loaded(tmp_path / "datasets", "org/chats", new, new_repo)
    for source, content in (("org/chats", "new"), (f"org/chats@{new}", "new"), (f"org/chats@{old}", "old")):
        (prompt,) = load_prompts([source])
        assert prompt.messages == [{"role": "user", "content": content}]
    digests = [source_digest(s, demo_prompts_path()) for s in ("org/chats", f"org/chats@{new}", f"org/chats@{old}")]
    assert digests[0] == digests[1] != digests[2]


def test_source_digest_follows_content(tmp_path):
    folder = save_to_disk(tmp_path / "saved", [{"prompt": "a"}])
    before = source_digest(str(folder), demo_prompts_path())
    save_to_disk(folder, [{"prompt": "b"}])
    assert source_digest(str(folder), demo_prompts_path()) != before
    split = save_dict_to_disk(tmp_path / "dict", {"train": [{"prompt": "a"}], "test": [{"prompt": "b"}]})
    assert source_digest(str(split), demo_prompts_path()) == source_digest(str(split / "train"), demo_prompts_path())
    assert source_digest(str(tmp_path / "gone.jsonl"), demo_prompts_path()) == "missing"
