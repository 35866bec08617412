"""Prompt data as users have it, written to disk: ShareGPT and OpenAI conversations, and tools; a folder
written by `datasets`' own `save_to_disk` (a Dataset or a DatasetDict); `datasets`' own cache of a Hub dataset
as a `load_dataset` leaves it. `datasets` is imported by the helpers that write with it, not with this module."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

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
    """`datasets.Dataset.from_list(rows).save_to_disk(folder)`."""
    from datasets import Dataset

    Dataset.from_list(rows).save_to_disk(str(folder))
    return folder


def save_dict_to_disk(folder: Path, splits: dict[str, list[dict[str, Any]]]) -> Path:
    """`datasets.DatasetDict(...).save_to_disk(folder)`: a folder per split and `dataset_dict.json`."""
    from datasets import Dataset, DatasetDict

    DatasetDict({split: Dataset.from_list(rows) for split, rows in splits.items()}).save_to_disk(str(folder))
    return folder


def use_datasets_cache(monkeypatch: pytest.MonkeyPatch, cache: Path) -> None:
    """Point `datasets` at its own cache `cache`, offline, in this process: the environment, and the settings
    `datasets.config` read from it when it was imported."""
    from datasets import config

    monkeypatch.setenv("HF_DATASETS_CACHE", str(cache))
    monkeypatch.setattr(config, "HF_DATASETS_CACHE", cache)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(config, "HF_HUB_OFFLINE", True)


def prepare_as_loaded(cache: Path, repo_id: str, commit: str, repo: Path) -> None:
    """`datasets`' own cache of Hub dataset `repo_id` at `commit`, as `load_dataset(repo_id)` leaves it: the
    builder `datasets` makes of the repo's data files (read here from the folder `repo` instead of fetched),
    prepared under the repo's name and the commit as its hash, in `org___name/<config>/<version>/<commit>`. A
    builder given `repo_id` refuses files from outside the Hub, so it is prepared under the bare name and
    moved under the namespace."""
    from datasets.load import dataset_module_factory, get_dataset_builder_class

    module = dataset_module_factory(str(repo))
    kwargs = {key: value for key, value in module.builder_kwargs.items() if key != "dataset_name"}
    namespace, name = repo_id.split("/")
    builder_class = get_dataset_builder_class(module, dataset_name=name)
    staging = cache.with_name(f"{cache.name}-staging")
    builder = builder_class(cache_dir=str(staging), dataset_name=name, hash=commit, **kwargs)
    builder.download_and_prepare()
    prepared = Path(builder.cache_dir)
    target = cache / f"{namespace}___{name}" / prepared.relative_to(staging / name)
    target.parent.mkdir(parents=True, exist_ok=True)
    prepared.rename(target)
