"""The target's identity is its content: weights overwritten in place with others of the same shape, or a new
generation_config.json (vLLM applies its sampling defaults), make another target digest; an untouched folder
keeps its digest and is hashed once; a Hub snapshot's weights are known by their blobs' names, never read.
And what the target is, is decided by `target.reference` alone."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from eagle3_core.config import TargetConfig
from eagle3_core.events import RunEvents
from eagle3_core.target import digest
from eagle3_core.target.prepare import describe_folder, prepare_target
from eagle3_core.target.reference import reference_of
from tests.helpers.hub_cache import add_commit, use_hub_cache

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 8, "hidden_size": 16,
          "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 32, "vocab_size": 64,
          "tie_word_embeddings": True}  # fmt: skip


def tiny_folder(root: Path, seed: int = 0) -> Path:
    """A folder of config.json, generation_config.json, a (word-level) tokenizer and one safetensors file of
    random weights."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(CONFIG))
    (root / "tokenizer.json").write_text(json.dumps({"model": {"type": "WordLevel", "vocab": {"a": 0}}}))
    (root / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.9}))
    write_weights(root, seed)
    return root


def write_weights(root: Path, seed: int) -> None:
    weights = torch.randn(64, 16, generator=torch.Generator().manual_seed(seed))  # [vocab, H]
    save_file({"model.embed_tokens.weight": weights}, str(root / "model.safetensors"))


def test_weights_overwritten_in_place_with_the_same_shape_are_another_target(tmp_path: Path):
    folder, cache = tiny_folder(tmp_path / "model"), tmp_path / "cache"
    before = describe_folder(folder, "m", "local", cache)
    size = (folder / "model.safetensors").stat().st_size
    write_weights(folder, seed=1)
    assert (folder / "model.safetensors").stat().st_size == size, "same shape, same size: only content differs"
    after = describe_folder(folder, "m", "local", cache)
    assert after.weights == before.weights and after.config_digest == before.config_digest
    assert after.digest != before.digest


def test_generation_config_is_part_of_the_digest(tmp_path: Path):
    folder, cache = tiny_folder(tmp_path / "model"), tmp_path / "cache"
    before = describe_folder(folder, "m", "local", cache)
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 1.0}))
    assert describe_folder(folder, "m", "local", cache).digest != before.digest


def test_an_untouched_folder_keeps_its_digest_and_is_hashed_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    folder, cache = tiny_folder(tmp_path / "model"), tmp_path / "cache"
    first = describe_folder(folder, "m", "local", cache)
    hashed: list[Path] = []
    real = digest.sha256_file
    monkeypatch.setattr(digest, "sha256_file", lambda path: hashed.append(path) or real(path))
    assert describe_folder(folder, "m", "local", cache).digest == first.digest
    assert hashed == [], "the weights' digest is kept by (path, size, mtime, inode)"
    os.utime(folder / "model.safetensors", ns=(1, 1))
    assert describe_folder(folder, "m", "local", cache).digest == first.digest
    assert hashed == [folder / "model.safetensors"], "a touched file is hashed again (same content: same digest)"


def test_a_plan_never_hashes_weights_it_has_not_seen(tmp_path: Path):
    folder, cache = tiny_folder(tmp_path / "model"), tmp_path / "cache"
    unseen = describe_folder(folder, "m", "local", cache, hash_weights=False)
    assert [f.path for f in unseen.files if f.path.endswith(".safetensors")] == []
    assert not cache.exists(), "nothing written"
    seen = describe_folder(folder, "m", "local", cache)
    assert describe_folder(folder, "m", "local", cache, hash_weights=False).digest == seen.digest


def test_a_hub_snapshots_weights_are_known_by_their_blobs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    source = tiny_folder(tmp_path / "source")
    add_commit(tmp_path / "hub", "org/tiny", source)
    use_hub_cache(monkeypatch, tmp_path / "hub")
    monkeypatch.setattr(digest, "sha256_file", lambda path: pytest.fail(f"{path} was read whole"))
    events = RunEvents(tmp_path / "run")
    target = prepare_target(TargetConfig(model="org/tiny", cache_dir=tmp_path / "cache"), events)
    weights = [f for f in target.files if f.path == "model.safetensors"]
    assert weights and weights[0].sha256 == digest.blob_digest(target.root_path / "model.safetensors")


def test_what_the_target_is_is_read_in_one_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(tmp_path)
    assert reference_of("smollm2-135m-instruct").kind == "embedded"
    assert (reference_of("org/name@v1").kind, str(reference_of("org/name@v1").hub)) == ("hub", "org/name@v1")
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert reference_of("org/name").kind == "local", "an existing folder wins over a Hub id spelt the same"
    assert reference_of("/no/such/folder").kind == "local"
