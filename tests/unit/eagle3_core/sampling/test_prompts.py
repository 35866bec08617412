"""Prompt sources: JSONL and Parquet, `messages` or `prompt`, stable ids, the bundled demo set, and errors
that name the file and line."""

from __future__ import annotations

import json
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eagle3_core.sampling.prompts import DEMO, PromptFileError, load_prompts, prompt_id


def write_jsonl(path, records):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n")
    return path


def test_jsonl_prompt_and_messages_with_and_without_id(tmp_path):
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "What is 2+2?"}, {"id": 7, "messages": chat}, ""])
    first, second = load_prompts([str(path)])
    assert first.messages == [{"role": "user", "content": "What is 2+2?"}]
    assert first.id == prompt_id(first.messages) and len(first.id) == 16
    assert second.id == "7" and second.messages == chat


def test_content_hash_id_is_stable_and_content_dependent():
    a = [{"role": "user", "content": "a"}]
    assert prompt_id(a) == prompt_id([{"role": "user", "content": "a"}])
    assert prompt_id(a) != prompt_id([{"role": "user", "content": "b"}])


def test_parquet_source(tmp_path):
    table = pa.table({"id": ["x", "y"], "prompt": ["one", "two"]})
    pq.write_table(table, tmp_path / "p.parquet")
    prompts = load_prompts([str(tmp_path / "p.parquet")])
    assert [(p.id, p.messages[0]["content"]) for p in prompts] == [("x", "one"), ("y", "two")]


def test_parquet_with_messages_column(tmp_path):
    messages = [[{"role": "user", "content": "hello"}]]
    pq.write_table(pa.table({"messages": messages}), tmp_path / "m.parquet")
    (prompt,) = load_prompts([str(tmp_path / "m.parquet")])
    assert prompt.messages == messages[0]


@pytest.mark.parametrize(
    ("bad_line", "reason"),
    [
        ('{"prompt": "ok"', "Expecting"),
        ('{"text": "no prompt field"}', "needs `messages`"),
        ('{"messages": [{"role": "robot", "content": "x"}]}', "role must be one of"),
        ('{"messages": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "q"}]}', "starts with"),
        ('{"conversations": [{"from": "alien", "value": "q"}]}', "from must be one of"),
        ('{"prompt": "q", "tools": [{"type": "function"}]}', r"tools\[0\]"),
        ('["a list"]', "expected a JSON object"),
    ],
)
def test_malformed_line_names_file_and_line(tmp_path, bad_line, reason):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "fine"}, "", bad_line])
    with pytest.raises(PromptFileError, match=rf"bad\.jsonl:3: .*{reason}"):
        load_prompts([str(path)])


def test_malformed_parquet_row_names_row(tmp_path):
    pq.write_table(pa.table({"prompt": ["fine", ""]}), tmp_path / "p.parquet")
    with pytest.raises(PromptFileError, match=r"p\.parquet: row 2"):
        load_prompts([str(tmp_path / "p.parquet")])


def test_missing_file_and_unknown_type(tmp_path):
    with pytest.raises(PromptFileError, match="not found"):
        load_prompts([str(tmp_path / "nope.jsonl")])
    (tmp_path / "p.txt").write_text("hi")
    with pytest.raises(PromptFileError, match="unknown prompt file type"):
        load_prompts([str(tmp_path / "p.txt")])


def test_exact_repeats_kept_once_conflicting_ids_rejected(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a"}, {"prompt": "a"}, {"id": "k", "prompt": "b"}])
    assert len(load_prompts([str(path)])) == 2
    clash = write_jsonl(tmp_path / "clash.jsonl", [{"id": "k", "prompt": "b"}, {"id": "k", "prompt": "c"}])
    with pytest.raises(PromptFileError, match=r"clash\.jsonl:2: id 'k' already names another prompt at .*:1"):
        load_prompts([str(clash)])


def test_max_prompts_takes_the_first(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": str(i)} for i in range(10)])
    assert [p.messages[0]["content"] for p in load_prompts([str(path)], max_prompts=3)] == ["0", "1", "2"]


def test_demo_set_is_large_diverse_and_unique():
    prompts = load_prompts([DEMO])
    assert len(prompts) >= 500
    assert len({p.id for p in prompts}) == len(prompts)
    texts = [p.messages[-1]["content"] for p in prompts]
    assert len(set(texts)) == len(texts)
    first_words = Counter(t.split()[0] for t in texts)
    assert first_words.most_common(1)[0][1] < 0.35 * len(texts)
    assert any(len(p.messages) > 1 for p in prompts)
    keywords = ("function", "Solve", "Explain", "poem", "step by step", "Compare")
    assert all(any(k in t for t in texts) for k in keywords)


def test_demo_set_has_multi_turn_and_tool_call_rows_among_the_demos_prompts():
    """configs/demo.yaml samples the first 128: the CPU flow meets conversations of three user turns and tools."""
    prompts = load_prompts([DEMO], max_prompts=128)
    assert sum(sum(m["role"] == "user" for m in p.messages) >= 3 for p in prompts) >= 2
    with_tools = [p for p in prompts if p.tools]
    assert len(with_tools) >= 2
    assert any(m.get("tool_calls") for p in with_tools for m in p.messages)
    assert any(m["role"] == "tool" for p in with_tools for m in p.messages)
