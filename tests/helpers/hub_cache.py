"""A real Hugging Face Hub cache, built offline from a model folder, as huggingface_hub lays one out:
`<cache>/models--org--name/blobs/<sha256>` holding each file's content once, `snapshots/<commit>/<file>`
relative symlinks to those blobs, and `refs/<revision>` holding the commit sha (no newline). With
`HF_HUB_OFFLINE=1` (or `local_files_only=True`), `snapshot_download` resolves it as it would a download."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest


def repo_folder(cache: Path, repo_id: str, repo_type: str = "model") -> Path:
    """`models--org--name` (`datasets--org--name`), huggingface_hub's folder of a model (dataset) repo."""
    return Path(cache) / (f"{repo_type}s--" + repo_id.replace("/", "--"))


def commit_sha(repo_id: str, parent: str | None) -> str:
    """A 40-hex commit sha, distinct for each (repo, parent) as a new commit's would be."""
    return hashlib.sha1(f"{repo_id}:{parent}".encode()).hexdigest()


def add_commit(cache: Path, repo_id: str, source: Path, revision: str = "main", repo_type: str = "model") -> str:
    """Write `source`'s files as a new commit of `repo_id` and point `refs/<revision>` at it; returns its sha.
    The parent is the commit the ref names now, so each call makes a new sha (same files: same blobs)."""
    repo = repo_folder(cache, repo_id, repo_type)
    ref = repo / "refs" / revision
    parent = ref.read_text() if ref.is_file() else None
    commit = commit_sha(repo_id, parent)
    snapshot = repo / "snapshots" / commit
    for file in sorted(p for p in Path(source).iterdir() if p.is_file()):
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        if not blob.exists():
            blob.parent.mkdir(parents=True, exist_ok=True)
            blob.write_bytes(data)
        link = snapshot / file.name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    ref.parent.mkdir(parents=True, exist_ok=True)
    ref.write_text(commit)
    return commit


def use_hub_cache(monkeypatch: pytest.MonkeyPatch, cache: Path, offline: bool = True, endpoint: str | None = None):
    """Point huggingface_hub at `cache` (offline, or at `endpoint`) in this process and in the processes it
    starts: the environment, and the settings huggingface_hub read from it when it was imported."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1" if offline else "0")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)
    if endpoint is not None:
        monkeypatch.setenv("HF_ENDPOINT", endpoint)
        monkeypatch.setattr(constants, "ENDPOINT", endpoint)
        monkeypatch.setattr(
            constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}"
        )
