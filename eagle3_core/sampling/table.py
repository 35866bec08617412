"""The on-disk form of a `SampleSet`: Parquet parts with one row per response (`sampling.responses_per_prompt`
of each prompt), written atomically.

Sampling writes the rows; extraction, vocab mapping and evaluation read them. A row's `id` is its sample id
(`sample_id`: the prompt's id for its first response), `prompt_id` and `response_index` say which prompt and
which of its responses it is. `messages` is the history the last answer was asked with (its earlier
assistant turns the target's own under `sampling.turns: all`), `reasoning`, `response` and `tool_calls` that
answer, `tools` the tools offered, `turns` the assistant turns the target answered. `input_ids` is the whole
conversation rendered with the target's chat template; `loss_mask` is 1 on the tokens of the target's answers
(reasoning and tool calls included), the only tokens a draft is trained to predict.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from eagle3_core.artifacts import SampleSet
from eagle3_core.files import atomic_path

STATUSES = ("ok", "error", "skipped")

SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("status", pa.string()),
        ("error", pa.string()),
        ("messages", pa.string()),
        ("reasoning", pa.string()),
        ("response", pa.string()),
        ("finish_reason", pa.string()),
        ("prompt_tokens", pa.int32()),
        ("completion_tokens", pa.int32()),
        ("input_ids", pa.list_(pa.int32())),
        ("loss_mask", pa.list_(pa.int8())),
        ("prompt_id", pa.string()),
        ("response_index", pa.int32()),
        ("tools", pa.string()),
        ("tool_calls", pa.string()),
        ("turns", pa.int32()),
    ]
)
JSON_COLUMNS = ("messages", "tools", "tool_calls")  # lists of dicts, stored as JSON text
DEFAULTS: dict[str, Any] = {
    "error": "",
    "reasoning": "",
    "response": "",
    "finish_reason": "",
    "prompt_tokens": 0,
    "completion_tokens": 0,
    "input_ids": [],
    "loss_mask": [],
    "response_index": 0,
    "tools": [],
    "tool_calls": [],
    "turns": 1,
}


def sample_id(prompt_id: str, response: int) -> str:
    """The id of a prompt's response number `response` (from 0): the prompt's own id for the first, so a run
    of one response per prompt keeps the ids it always had; `<prompt id>#<response>` for the others."""
    return prompt_id if response == 0 else f"{prompt_id}#{response}"


def normalise_row(row: dict[str, Any]) -> dict[str, Any]:
    """Fill defaults (a row without `prompt_id` is the first response of the prompt of its id) and
    serialise the JSON columns (`messages`, `tools`, `tool_calls`: lists of dicts) as JSON."""
    if row.get("status") not in STATUSES:
        raise ValueError(f"row {row.get('id')!r}: status must be one of {STATUSES}, got {row.get('status')!r}")
    out = {**DEFAULTS, "prompt_id": row.get("id"), **row}
    for name in JSON_COLUMNS:
        if not isinstance(out[name], str):
            out[name] = json.dumps(out[name], ensure_ascii=False)
    if len(out["input_ids"]) != len(out["loss_mask"]):
        raise ValueError(f"row {out['id']!r}: input_ids and loss_mask differ in length")
    return {name: out[name] for name in SCHEMA.names}


def write_part(rows: list[dict[str, Any]], path: Path) -> Path:
    """Write one Parquet part atomically: readers see all of its rows or none."""
    table = pa.Table.from_pylist([normalise_row(r) for r in rows], schema=SCHEMA)
    with atomic_path(path, needed=table.nbytes) as tmp:
        pq.write_table(table, tmp, compression="zstd")
    return path


def read_part(path: Path) -> list[dict[str, Any]]:
    """The rows of one part; a part written before rows recorded their prompt (no `prompt_id` column) holds
    one response per prompt: its rows read as response 0 of the prompt of their id; one written before
    tools and turns were recorded, rows of one turn without tools."""
    rows = pq.read_table(path, schema=SCHEMA).to_pylist()
    for row in rows:
        for name in JSON_COLUMNS:
            row[name] = json.loads(row[name]) if row[name] else []
        row["turns"] = 1 if row["turns"] is None else row["turns"]
        if row["prompt_id"] is None:
            row["prompt_id"], row["response_index"] = row["id"], 0
    return rows


def iter_rows(sample_set: SampleSet, status: str | None = "ok") -> Iterator[dict[str, Any]]:
    """Rows of every part in the manifest's order, filtered by status (None: all rows); rows the set does not
    hold (`unasked`) are skipped."""
    unasked = set(sample_set.unasked)
    for record in sample_set.files:
        if record.path.endswith(".parquet"):
            for row in read_part(sample_set.path_of(record.path)):
                if (status is None or row["status"] == status) and row["id"] not in unasked:
                    yield row


def is_heldout(prompt_id: str, fraction: float) -> bool:
    """Deterministic held-out split by prompt id: the same prompt is held out in every run and phase,
    so evaluation never measures on a prompt the draft was trained on."""
    bucket = int.from_bytes(hashlib.sha256(prompt_id.encode()).digest()[:8], "big") / 2**64
    return bucket < fraction


def row_heldout(row: dict[str, Any], fraction: float) -> bool:
    """Whether a row's prompt is held out (`is_heldout`): every response of a held-out prompt is."""
    return is_heldout(row["prompt_id"], fraction)


def training_rows(sample_set: SampleSet, holdout_fraction: float) -> list[dict[str, Any]]:
    """The rows whose states training reads: ok rows with tokens that are not held out for evaluation, in the
    SampleSet's order (extraction stores them; online training asks the engine for them)."""
    return [
        row for row in iter_rows(sample_set, status="ok") if row["input_ids"] and not row_heldout(row, holdout_fraction)
    ]
