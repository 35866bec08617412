import json
import os
from pathlib import Path

import pytest

from eagle3_core import artifacts
from eagle3_core.artifacts import ArtifactInvalid, FileRecord, SampleSet, VocabMap
from eagle3_core.files import sha256_file


def make_manifest(root, **fields) -> SampleSet:
    (root / "parts").mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(2):
        path = root / "parts" / f"part-{i}.bin"
        path.write_bytes(os.urandom(64))
        paths.append(path)
    return SampleSet(root=str(root), files=[FileRecord.of(p, root) for p in paths], prompts=2, ok=2, **fields)


def test_json_round_trip_keeps_digest(tmp_path):
    manifest = make_manifest(tmp_path, errors={"p3": "HTTP 400"})
    loaded = SampleSet.load(manifest.save())
    assert loaded == manifest
    assert loaded.digest == manifest.digest


def test_digest_is_content_not_location(tmp_path):
    a = make_manifest(tmp_path / "a")
    moved = a.model_copy(update={"root": str(tmp_path / "elsewhere")})
    assert moved.digest == a.digest
    assert a.model_copy(update={"ok": 1}).digest != a.digest
    assert VocabMap(root=str(tmp_path)).digest != SampleSet(root=str(tmp_path)).digest


def test_validate_catches_missing_file(tmp_path):
    manifest = make_manifest(tmp_path)
    manifest.validate()
    (tmp_path / "parts" / "part-1.bin").unlink()
    with pytest.raises(ArtifactInvalid, match=r"part-1\.bin: missing"):
        manifest.validate()


def test_validate_catches_changed_file_of_same_size(tmp_path):
    manifest = make_manifest(tmp_path)
    (tmp_path / "parts" / "part-0.bin").write_bytes(os.urandom(64))
    with pytest.raises(ArtifactInvalid, match="content changed"):
        manifest.validate()


def test_validate_catches_truncated_file(tmp_path):
    manifest = make_manifest(tmp_path)
    with open(tmp_path / "parts" / "part-0.bin", "r+b") as f:
        f.truncate(10)
    with pytest.raises(ArtifactInvalid, match="size 10"):
        manifest.validate()


def test_touched_but_identical_file_still_valid(tmp_path, monkeypatch):
    manifest = make_manifest(tmp_path)
    touched = tmp_path / "parts" / "part-0.bin"
    mtime_ns = touched.stat().st_mtime_ns + 10**9
    os.utime(touched, ns=(mtime_ns, mtime_ns))
    hashed = []

    def spy(path, *args, **kwargs):
        hashed.append(Path(path).name)
        return sha256_file(path, *args, **kwargs)

    monkeypatch.setattr(artifacts, "sha256_file", spy)
    assert manifest.is_valid()
    assert hashed == ["part-0.bin"], "the touched file is re-hashed (and matches); the untouched one is not"


def test_edited_manifest_is_refused(tmp_path):
    path = make_manifest(tmp_path).save()
    data = json.loads(path.read_text())
    data["ok"] = 1
    path.write_text(json.dumps(data))
    with pytest.raises(ArtifactInvalid, match="digest does not match"):
        SampleSet.load(path)


def test_a_sample_set_without_unasked_rows_keeps_the_digest_it_had_before_they_were_recorded(tmp_path):
    """`unasked` (rows kept for a larger prompt set) is digested only where there are some: every SampleSet
    written before it keeps its digest, and with it every downstream cache key."""
    sample_set = SampleSet(root=str(tmp_path), ok=2, config={"sampling": {"temperature": 0.0}})
    content = sample_set.model_dump(mode="json", exclude={"root", "digest", "responses_per_prompt", "unasked"})
    content["files"] = []
    assert sample_set.digest == artifacts.sha256_json({"kind": SampleSet.kind, **content})
    assert sample_set.model_copy(update={"unasked": ["p9"]}).digest != sample_set.digest
