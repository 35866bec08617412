"""Prompt data as users have it, written to disk: a `datasets` folder as `Dataset.save_to_disk` lays one out
(`data-00000-of-00001.arrow` in Arrow's IPC stream format, `dataset_info.json`, `state.json`; a DatasetDict
adds `dataset_dict.json` and a folder per split), ShareGPT and OpenAI conversations, and tools."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
SHAREGPT_ROW = {
    "id": "share-1",
    "conversations": [
        {"from": "system", "value": "Be brief."},
        {"from": "human", "value": "Name a prime number."},
        {"from": "gpt", "value": "7"},
        {"from": "human", "value": "And one larger than 100?"},
    ],
}
TOOL_ROW = {
    "id": "tools-1",
    "tools": [WEATHER_TOOL],
    "messages": [
        {"role": "user", "content": "Is it raining in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"rain": true}'},
        {"role": "assistant", "content": "Yes, it is raining in Paris."},
    ],
}


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def save_to_disk(folder: Path, rows: list[dict[str, Any]]) -> Path:
    """`datasets.Dataset.from_list(rows).save_to_disk(folder)`, written with pyarrow alone."""
    folder.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pylist(rows)
    name = "data-00000-of-00001.arrow"
    with pa.OSFile(str(folder / name), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    (folder / "dataset_info.json").write_text(json.dumps({"citation": "", "description": "", "features": {}}))
    state = {
        "_data_files": [{"filename": name}],
        "_fingerprint": "0123456789abcdef",
        "_format_columns": None,
        "_format_kwargs": {},
        "_format_type": None,
        "_output_all_columns": False,
        "_split": None,
    }
    (folder / "state.json").write_text(json.dumps(state))
    return folder


def save_dict_to_disk(folder: Path, splits: dict[str, list[dict[str, Any]]]) -> Path:
    """`datasets.DatasetDict(...).save_to_disk(folder)`: a folder per split and `dataset_dict.json`."""
    for split, rows in splits.items():
        save_to_disk(folder / split, rows)
    (folder / "dataset_dict.json").write_text(json.dumps({"splits": list(splits)}))
    return folder
