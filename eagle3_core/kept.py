"""Results of other settings, kept: a phase folder whose key no longer matches the configuration is moved
aside under `<run_dir>/kept/<folder>/<key id>/`, never deleted, and moved back when its key is asked for again.

A folder's key lives in its key file. Moving files within one filesystem is a rename, so setting aside costs no
copy; a crash in the middle leaves every file in one of the two places, and the next run finishes the move:
`set_aside` moves the key file last (the folder keeps naming the key of the files still in it), `bring_back`
moves it first (the kept folder's remaining files are brought back by the next run of that key).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from eagle3_core.files import sha256_json


def key_id(key: Any) -> str:
    """The name of a key's kept folder: 16 hex digits of its digest."""
    return sha256_json(key)[:16]


def entries(folder: Path) -> list[Path]:
    """The plain files directly in `folder` (sub-folders, such as a host's slice, stay where they are)."""
    return sorted(p for p in folder.iterdir() if p.is_file()) if folder.is_dir() else []


def move_files(source: Path, destination: Path, key_file: str, key_first: bool) -> int:
    """Move the plain files of `source` into `destination` (replacing same-named files there), the key file
    first or last; returns how many moved."""
    files = [p for p in entries(source) if p.name != key_file]
    key = [p for p in entries(source) if p.name == key_file]
    ordered = [*key, *files] if key_first else [*files, *key]
    if not ordered:
        return 0
    destination.mkdir(parents=True, exist_ok=True)
    for path in ordered:
        os.replace(path, destination / path.name)
    return len(ordered)


def set_aside(folder: Path, kept: Path, key_file: str) -> int:
    """Move every file of `folder` into `kept` (its key file last); returns how many moved."""
    return move_files(folder, kept, key_file, key_first=False)


def bring_back(kept: Path, folder: Path, key_file: str) -> int:
    """Move the files of `kept` back into `folder` (its key file first) and drop the empty `kept`; returns how
    many moved."""
    moved = move_files(kept, folder, key_file, key_first=True)
    if kept.is_dir() and not any(kept.iterdir()):
        kept.rmdir()
    return moved


def changed_fields(old: Any, new: Any, prefix: str = "") -> list[str]:
    """Dotted paths of the values that differ between two keys (nested dicts compared field by field)."""
    if not isinstance(old, dict) or not isinstance(new, dict):
        return [] if old == new else [prefix or "key"]
    changed: list[str] = []
    for name in sorted(set(old) | set(new), key=str):
        path = f"{prefix}.{name}" if prefix else str(name)
        if name not in old or name not in new:
            changed.append(path)
        else:
            changed += changed_fields(old[name], new[name], path)
    return changed


def changed_line(old: Any, new: Any) -> str:
    """`a.b, c.d changed` (at most four named, as the configuration names them: a key's "config." prefix left
    out, its "key" digest not a field), or `settings changed` where the old key does not say."""
    says = isinstance(old, dict) and set(old) != {"key"}  # a bare digest (a key file of earlier versions) does not
    changed = changed_fields(old, new) if says else []
    fields = [f.removeprefix("config.") for f in changed if f != "key"]
    if not fields:
        return "settings changed"
    shown = ", ".join(fields[:4]) + (f" and {len(fields) - 4} more" if len(fields) > 4 else "")
    return f"{shown} changed"


def switch_key(
    folder: Path,
    kept_root: Path,
    key_file: str,
    stored: Any,
    key: Any,
    name: Callable[[Any], str],
    what: str,
) -> list[str]:
    """Make `folder` the folder of `key`: when it holds files of another key (`stored`, its key file read;
    None: unknown, left alone), they are set aside under `kept_root/<name(stored)>`; files of `key` kept there
    come back. Returns the DECISION lines to record (the first names the fields that changed)."""
    lines = []
    if stored is not None and name(stored) != name(key) and entries(folder):
        aside = kept_root / name(stored)
        moved = set_aside(folder, aside, key_file)
        lines.append(
            f"{changed_line(stored, key)}: the {moved} {what} files of the other settings kept in {aside}, "
            "back when those settings are asked for again"
        )
    back = kept_root / name(key)
    if back.is_dir():
        moved = bring_back(back, folder, key_file)
        lines.append(f"{what} of these settings brought back from {back} ({moved} files)")
    return lines
