"""Results of other settings set aside and brought back on real folders: the decision line names the fields
that changed, files only move, and a move killed midway is finished by the next run of either key."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from eagle3_core.kept import changed_line, entries, key_id, switch_key

OLD = {"sampling": {"temperature": 0.0, "max_tokens": 32}, "target": "a"}
NEW = {"sampling": {"temperature": 0.5, "max_tokens": 32}, "target": "a"}


def folder_of(root: Path, key: dict, files: dict[str, str]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "key.json").write_text(repr(key))
    for name, text in files.items():
        (root / name).write_text(text)
    return root


@pytest.mark.parametrize(
    ("old", "new", "line"),
    [
        (OLD, NEW, "sampling.temperature changed"),
        ({"config": {"training": {"lr": 1}}, "key": "x"}, {"config": {"training": {"lr": 2}}, "key": "y"},
         "training.lr changed"),
        ({"key": "x"}, {"config": {}, "key": "y"}, "settings changed"),
        (dict.fromkeys("abcde", 1), dict.fromkeys("abcde", 2), "a, b, c, d and 1 more changed"),
    ],
)  # fmt: skip
def test_the_decision_line_names_the_fields_that_changed(old, new, line):
    assert changed_line(old, new) == line


def test_a_changed_key_sets_the_files_aside_and_the_old_key_brings_them_back(tmp_path: Path):
    folder = folder_of(tmp_path / "samples", OLD, {"part-00000.parquet": "rows", "sample_set.json": "{}"})
    kept = tmp_path / "kept"
    [line] = switch_key(folder, kept, "key.json", OLD, NEW, key_id, "sample")
    assert line.startswith("sampling.temperature changed: the 3 sample files") and str(kept / key_id(OLD)) in line
    assert entries(folder) == [] and (kept / key_id(OLD) / "part-00000.parquet").read_text() == "rows"
    (folder / "part-00000.parquet").write_text("new rows")
    (folder / "key.json").write_text(repr(NEW))
    lines = switch_key(folder, kept, "key.json", NEW, OLD, key_id, "sample")
    assert len(lines) == 2 and "brought back" in lines[1]
    assert (folder / "part-00000.parquet").read_text() == "rows" and (folder / "sample_set.json").exists()
    assert (kept / key_id(NEW) / "part-00000.parquet").read_text() == "new rows"
    assert not (kept / key_id(OLD)).exists()


def test_a_move_killed_midway_is_finished_by_the_next_run(tmp_path: Path, monkeypatch):
    """Killed after the first file moved: the folder still names its key, and the next run of the new key
    moves the rest; nothing is in two places or lost."""
    folder = folder_of(tmp_path / "states", OLD, {"step-1.pt": "1", "step-2.pt": "2"})
    kept, real, moved = tmp_path / "kept", os.replace, []

    def killed_after_one(source, destination):
        if moved:
            raise KeyboardInterrupt
        moved.append(source)
        real(source, destination)

    monkeypatch.setattr(os, "replace", killed_after_one)
    with pytest.raises(KeyboardInterrupt):
        switch_key(folder, kept, "key.json", OLD, NEW, key_id, "training state")
    monkeypatch.undo()
    assert (folder / "key.json").exists(), "the key file moves last"
    switch_key(folder, kept, "key.json", OLD, NEW, key_id, "training state")
    assert sorted(p.name for p in (kept / key_id(OLD)).iterdir()) == ["key.json", "step-1.pt", "step-2.pt"]
