"""Measurements saved with the digest of their inputs, so that a run cut short resumes from what it finished
and a changed input measures again."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from eagle3_core.files import write_text_atomic


def load_saved(path: Path, key: str) -> dict[str, Any] | None:
    """A measurement saved under `key`, or None (absent, unreadable or made from other inputs)."""
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return saved["result"] if saved.get("key") == key else None


def save(path: Path, key: str, result: dict[str, Any]) -> None:
    write_text_atomic(path, json.dumps({"key": key, "result": result}, indent=1))
