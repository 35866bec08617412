"""Targets named by a Hugging Face Hub id, on real Hub caches built from the tiny Llama (tests/helpers/hub_cache.py)
and a real HTTP stand-in for the Hub (tests/helpers/hub_standin.py): id parsing, offline resolution to the
snapshot folder and its commit, the commit in prepare_target's cache key and in the TargetModel's digest, a
moved ref's decision line, resumed downloads with progress, and each failure as one `error:` line that never
holds HF_TOKEN."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from huggingface_hub import constants

from eagle3_core.config import PipelineConfig, TargetConfig
from eagle3_core.events import DECISION, RunEvents
from eagle3_core.progress import ProgressUpdate
from eagle3_core.target.hub import HubId, HubTargetError
from eagle3_core.target.prepare import prepare_target
from eagle3_core.target.reference import parse_hub_id, reference_of
from tasks.target import POLICY
from tests.helpers.hub_cache import add_commit, repo_folder, use_hub_cache
from tests.helpers.hub_standin import HubRepo, hub_standin

REPO = Path(__file__).resolve().parents[4]
TOKEN = "hf_SecretTokenForTests0123456789abcdef"
SHA = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tmp_path: Path, tiny_llama, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An offline Hub cache holding `org/tiny` (the tiny Llama) at one commit of `main`."""
    cache = tmp_path / "hub"
    add_commit(cache, "org/tiny", tiny_llama.root_path)
    use_hub_cache(monkeypatch, cache)
    return cache


def test_hub_ids_parse_and_an_existing_folder_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    assert parse_hub_id("org/name") == HubId("org/name", "main")
    assert parse_hub_id("meta-llama/Llama-3.1-8B-Instruct@main") == HubId("meta-llama/Llama-3.1-8B-Instruct", "main")
    assert parse_hub_id(f"org/name@{SHA}") == HubId("org/name", SHA) and HubId("org/name", SHA).pinned
    assert parse_hub_id("org/name@refs/pr/1") == HubId("org/name", "refs/pr/1")
    for not_an_id in ("smollm2-135m-instruct", "/abs/org/name", "./org/name", "a/b/c", "org/", "org/name@"):
        assert parse_hub_id(not_an_id) is None, not_an_id
    monkeypatch.chdir(tmp_path)
    assert reference_of("org/name").hub == HubId("org/name")
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert reference_of("org/name").hub is None, "an existing folder wins over a Hub id spelt the same"


def test_offline_hub_id_resolves_to_its_snapshot_and_commit(hub_cache: Path, tiny_llama, tmp_path: Path):
    events = RunEvents(tmp_path / "run")
    commit = (repo_folder(hub_cache, "org/tiny") / "refs" / "main").read_text()
    target = prepare_target(TargetConfig(model="org/tiny"), events)
    assert target.root_path == repo_folder(hub_cache, "org/tiny") / "snapshots" / commit
    assert (target.name, target.repo_id, target.revision, target.commit) == ("org/tiny", "org/tiny", "main", commit)
    assert target.source == f"hub:org/tiny@{commit}"
    assert (target.config_digest, target.tokenizer_digest) == (tiny_llama.config_digest, tiny_llama.tokenizer_digest)
    target.validate(deep=True)
    [decision] = [e for e in events.read() if e["event"] == DECISION]
    assert decision["message"].startswith(f"target org/tiny@main is commit {commit[:7]}")
    pinned = prepare_target(TargetConfig(model=f"org/tiny@{commit}"), events)
    assert pinned.root_path == target.root_path and pinned.digest == target.digest


def test_a_moved_ref_changes_the_key_and_the_digest_and_says_so(hub_cache: Path, tiny_llama, tmp_path: Path):
    config = PipelineConfig.model_validate({"run_dir": str(tmp_path / "run"), "target": {"model": "org/tiny"}})
    events = RunEvents(config.run_dir)
    first = prepare_target(config.target, events)
    key = POLICY.key_content(config, {})
    assert key["extra"] == {"repo_id": "org/tiny", "commit": first.commit}
    assert POLICY.key_content(config, {}) == key, "an unmoved ref keeps the key"
    moved = add_commit(hub_cache, "org/tiny", tiny_llama.root_path)
    assert POLICY.key_content(config, {})["extra"]["commit"] == moved
    second = prepare_target(config.target, events)
    assert second.commit == moved and second.root_path.name == moved
    assert second.digest != first.digest, "phases after prepare_target key on the digest: no data of two commits"
    last = events.read()[-1]
    assert last["message"] == (
        f"target org/tiny: refs/main moved {first.commit[:7]} -> {moved[:7]}; re-running from prepare_target"
    )


def test_offline_without_the_snapshot_or_with_half_of_it_is_one_clear_error(hub_cache: Path, tmp_path: Path):
    events = RunEvents(tmp_path / "run")
    config = PipelineConfig.model_validate({"run_dir": str(tmp_path / "run"), "target": {"model": "org/absent"}})
    with pytest.raises(HubTargetError, match=r"HF_HUB_OFFLINE is set and the Hub cache .* has no snapshot of it"):
        prepare_target(config.target, events)
    unresolved = POLICY.key_content(config, {})["extra"]["unresolved"]
    assert "has no snapshot of it" in unresolved, "the key still computes; the task fails with the error line"
    snapshot = prepare_target(TargetConfig(model="org/tiny"), events).root_path
    (snapshot / "model.safetensors").unlink()
    with pytest.raises(HubTargetError, match="lacks its weights: run once with network access"):
        prepare_target(TargetConfig(model="org/tiny"), events)


def test_download_takes_serving_files_only_resumes_and_reports_progress(
    tiny_llama, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """A file already in the cache is not fetched again; a connection cut mid-file resumes at the byte it
    stopped (HTTP Range), and the bytes reach the progress callback once each, with MB/s and an ETA."""
    source = tmp_path / "source"
    source.mkdir()
    for file in tiny_llama.root_path.iterdir():
        (source / file.name).write_bytes(file.read_bytes())
    (source / "README.md").write_text("# not needed to serve")
    weights = (source / "model.safetensors").read_bytes()
    cache = tmp_path / "hub"
    tokenizer = (source / "tokenizer.json").read_bytes()  # downloaded by an earlier, interrupted run
    blob = repo_folder(cache, "org/tiny") / "blobs" / hashlib.sha256(tokenizer).hexdigest()
    blob.parent.mkdir(parents=True)
    blob.write_bytes(tokenizer)
    updates: list[ProgressUpdate] = []
    with hub_standin({"org/tiny": HubRepo(source, SHA)}, cut_once={"model.safetensors"}) as (endpoint, hub):
        use_hub_cache(monkeypatch, cache, offline=False, endpoint=endpoint)
        target = prepare_target(TargetConfig(model="org/tiny"), RunEvents(tmp_path / "run"), updates.append)
    assert target.commit == SHA and (target.root_path / "model.safetensors").read_bytes() == weights
    fetched = [Path(path).name for method, path, _, _ in hub.requests if method == "GET" and "/resolve/" in path]
    assert {"model.safetensors", "config.json", "generation_config.json"} <= set(fetched)
    assert not {"README.md", "target_model.json", "tokenizer.json"} & set(fetched), "serving files, not cached"
    ranges = [r for method, path, r, _ in hub.requests if method == "GET" and path.endswith("/model.safetensors")]
    kept = (len(weights) - 1) // constants.DOWNLOAD_CHUNK_SIZE * constants.DOWNLOAD_CHUNK_SIZE  # chunks written
    assert kept > 0 and ranges == [None, f"bytes={kept}-"], "the cut download resumes where it stopped"
    last = updates[-1]
    assert (last.phase, last.stage, last.unit, last.rate_unit) == ("prepare_target", "download", "MB", "MB/s")
    assert last.done == last.total and last.rate is not None and last.eta_s == 0
    assert last.total == round(sum((source / name).stat().st_size for name in set(fetched)) / 1e6, 1), "to fetch"


def cli_prepare(model: str, run_dir: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """`eagle3 prepare-target MODEL` in its own process, with the Hub settings in its environment only."""
    command = [sys.executable, "-m", "cli", "prepare-target", model, "--set", f"run_dir={run_dir}"]
    env = {**os.environ, "COLUMNS": "1000", **env}  # the printed manifest unwrapped
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.parametrize(
    ("model", "says"),
    [
        ("org/gated", "org/gated is gated and HF_TOKEN's account has no access: accept its terms on"),
        ("org/unknown", "no repository org/unknown on http://127.0.0.1"),
        ("org/tiny@no-such-branch", "org/tiny has no revision 'no-such-branch': name a branch, tag or commit"),
    ],
)
def test_hub_failures_are_one_error_line_and_the_token_stays_secret(model: str, says: str, tiny_llama, tmp_path: Path):
    """The real CLI against the stand-in Hub (HF_ENDPOINT), HF_TOKEN set: huggingface_hub sends the token, and
    neither the error line nor anything the run wrote holds it."""
    repos = {"org/tiny": HubRepo(tiny_llama.root_path, SHA), "org/gated": HubRepo(tiny_llama.root_path, SHA, True)}
    run_dir = tmp_path / "run"
    with hub_standin(repos) as (endpoint, hub):
        env = {"HF_ENDPOINT": endpoint, "HF_TOKEN": TOKEN, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "0"}
        result = cli_prepare(model, run_dir, env)
    assert result.returncode == 1
    [line] = result.stdout.strip().splitlines()
    assert line.startswith(f"error: target.model {parse_hub_id(model)}: ") and says in line, result.stderr
    repo_requests = [auth for _, path, _, auth in hub.requests if path.startswith(("/api/models/", "/org/"))]
    assert repo_requests and set(repo_requests) == {f"Bearer {TOKEN}"}, "HF_TOKEN is what huggingface_hub sends"
    written = [p.read_text(errors="replace") for p in tmp_path.rglob("*") if p.is_file() and not p.is_symlink()]
    assert all(TOKEN not in text for text in [result.stdout, result.stderr, *written])


def test_gated_without_a_token_says_to_set_one(tiny_llama, tmp_path: Path):
    with hub_standin({"org/gated": HubRepo(tiny_llama.root_path, SHA, True)}) as (endpoint, _):
        # No HF_TOKEN, and an HF_HOME with no stored token either.
        env = {"HF_ENDPOINT": endpoint, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "0", "HF_TOKEN": ""}
        result = cli_prepare("org/gated", tmp_path / "run", {**env, "HF_HOME": str(tmp_path / "home")})
    assert result.returncode == 1
    [line] = result.stdout.strip().splitlines()
    assert line.startswith("error: target.model org/gated@main: org/gated is gated: accept its terms on")
    assert "set HF_TOKEN" in line


def test_the_manifest_printed_by_the_cli_holds_repo_and_commit(hub_cache: Path, tmp_path: Path):
    env = {"HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "1", "HF_TOKEN": TOKEN}
    result = cli_prepare("org/tiny", tmp_path / "run", env)
    assert result.returncode == 0, result.stdout + result.stderr
    manifest = json.loads(result.stdout[result.stdout.index("{") :])
    commit = (repo_folder(hub_cache, "org/tiny") / "refs" / "main").read_text()
    assert (manifest["repo_id"], manifest["commit"], manifest["root"].endswith(commit)) == ("org/tiny", commit, True)
    assert TOKEN not in result.stdout + (tmp_path / "run" / "events.jsonl").read_text()
