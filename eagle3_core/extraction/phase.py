"""Phase 3, extract hidden states: prefill every training sample once and store its aux and last states.

Resume works per shard. The samples to extract (ok rows, not held out, in SampleSet order) are cut into
shards of the folder's `samples_per_shard` (`layout.json`: the value it was started with, a file layout that a
later change of the setting does not redo); each shard's plan key digests the phase key and its sample ids.
A shard counts as done when its completion record (`<shard>.done.json`, written after the shard) carries the
same plan key and the file still matches the recorded size and sha256 (re-hashed when its mtime changed): a
truncated or corrupt shard is rewritten, never trained on. The engine (one full weight load) starts only
when a shard is missing, so a re-run with every shard done loads no weights.

The folder's key (`key.json`: the phase key and the target) says whose states it holds: the states of another
key are set aside under `<run_dir>/kept/hidden_states/<key id>/` and come back when that key is asked for
again (`eagle3_core.kept`). Nothing in the folder is removed or rewritten before the preflight has passed and
the engine is up; shards beyond a smaller plan stay (a larger plan finds them done), and a complete shard of
another plan (other samples, e.g. fewer prompts) is set aside under `kept/hidden_states/shards/` rather than
written over, to come back when its plan does.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from eagle3_core.artifacts import ArtifactInvalid, FileRecord, HiddenStateSet, SampleSet, TargetModel
from eagle3_core.config import ExtractionConfig, PipelineConfig
from eagle3_core.dtypes import resolve_dtype
from eagle3_core.events import CACHE_HIT, DECISION, RESUME, RunEvents
from eagle3_core.extraction.preflight import preflight_extraction
from eagle3_core.files import remove_dead_temps, sha256_json, write_text_atomic
from eagle3_core.hidden_states.layers import resolve_layer_ids
from eagle3_core.hidden_states.reader import INDEX_FILE
from eagle3_core.hidden_states.storage import (
    LAST_STATE_NORMED,
    BackgroundShardWriter,
    ExtractionBackend,
    SampleRow,
    SampleStates,
    bytes_per_token,
    check_sample,
    shard_name,
)
from eagle3_core.hosts import host_slice, in_slice
from eagle3_core.kept import key_id, switch_key
from eagle3_core.phases import EXTRACTION, phase_key
from eagle3_core.progress import ProgressCallback, ProgressUpdate, RateMeter, ignore_progress
from eagle3_core.run_layout import RunLayout
from eagle3_core.sampling.table import training_rows
from eagle3_core.serving.shared import starts_engine

PHASE = EXTRACTION.name
DONE_SUFFIX = ".done.json"
KEY_FILE = "key.json"
LAYOUT_FILE = "layout.json"


def recorded_shard_size(out_dir: Path) -> int | None:
    """`samples_per_shard` of the folder's shards: from its `layout.json`, else (a folder from before it)
    from its manifest's config; None for a folder with neither."""
    readers = (
        lambda: json.loads((out_dir / LAYOUT_FILE).read_text())["samples_per_shard"],
        lambda: json.loads((out_dir / f"{HiddenStateSet.kind}.json").read_text())["config"]["extraction"][
            "samples_per_shard"
        ],
    )
    for read in readers:
        try:
            size = read()
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if isinstance(size, int) and size >= 1:
            return size
    return None


def shard_size(config: PipelineConfig) -> int:
    """The samples per shard of this run's folder: the layout it was started with, else the configured one."""
    return recorded_shard_size(RunLayout.of(config).hidden_states) or config.extraction.samples_per_shard


def folder_key(config: PipelineConfig, target: TargetModel) -> dict[str, Any]:
    """What the folder's states depend on (not its file layout): the fields marked content, the layer ids as
    resolved for this target, and the target."""
    return {
        "config": {**phase_key(config, EXTRACTION), "layer_ids": resolve_layer_ids(config, target)},
        "target": target.digest,
    }


def phase_config(config: PipelineConfig, target: TargetModel) -> dict[str, Any]:
    """The fields marked content (what is stored; not batch size, concurrency, device or the engine), the
    layer ids as resolved for this target, and the folder's samples per shard (`shard_size`; in the config
    of the manifest and of every shard's plan key, as it always was)."""
    cfg = folder_key(config, target)["config"]
    cfg["extraction"] = {**cfg["extraction"], "samples_per_shard": shard_size(config)}
    return cfg


def stored_folder_key(out_dir: Path) -> dict[str, Any] | None:
    """The folder's key: its `key.json`, else (a folder from before it) its manifest's config and target
    without the layout; None where neither says."""
    try:
        return json.loads((out_dir / KEY_FILE).read_text())
    except (OSError, ValueError):
        pass
    try:
        manifest = json.loads((out_dir / f"{HiddenStateSet.kind}.json").read_text())
        config = dict(manifest["config"])
        config["extraction"] = {k: v for k, v in config["extraction"].items() if k != "samples_per_shard"}
        return {"config": config, "target": manifest["upstream"]["target"]}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def take_folder_key(config: PipelineConfig, target: TargetModel, out_dir: Path, events: RunEvents) -> None:
    """Set aside the states of another key, bring back those of this one (`eagle3_core.kept.switch_key`);
    files only move. A folder keeping another layout than the configured one says so."""
    kept_root = RunLayout.of(config).kept(out_dir)
    stored = stored_folder_key(out_dir)
    for line in switch_key(out_dir, kept_root, KEY_FILE, stored, folder_key(config, target), key_id, "hidden-state"):
        events.record(PHASE, DECISION, line)
    size = recorded_shard_size(out_dir)
    if size is not None and size != config.extraction.samples_per_shard:
        events.record(
            PHASE,
            DECISION,
            f"extraction.samples_per_shard {config.extraction.samples_per_shard} applies to a new folder: "
            f"{out_dir} keeps its shards of {size} samples (a file layout, nothing extracted again)",
        )


def write_folder_key(out_dir: Path, key: dict[str, Any], samples_per_shard: int) -> None:
    """Record whose states the folder holds (`key.json`) and its layout (`layout.json`)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out_dir / KEY_FILE, json.dumps(key))
    write_text_atomic(out_dir / LAYOUT_FILE, json.dumps({"samples_per_shard": samples_per_shard}))


def upstream_of(sample_set: SampleSet, target: TargetModel) -> dict[str, str]:
    return {"sample_set": sample_set.digest, "target": target.digest}


def plan_shards(rows: list[SampleRow], samples_per_shard: int) -> list[list[SampleRow]]:
    return [rows[i : i + samples_per_shard] for i in range(0, len(rows), samples_per_shard)]


def shard_key(key: str, rows: list[SampleRow]) -> str:
    """A shard is done for this plan when the phase settings, the target and the very token ids of its
    samples are the same. The SampleSet digest is left out on purpose: new prompts change it, and must
    cost only the shards that hold new samples (the nightly run extracts only what is new)."""
    return sha256_json({"phase_key": key, "samples": [(r["id"], sha256_json(r["input_ids"])) for r in rows]})


def done_record(out_dir: Path, name: str, key: str) -> dict | None:
    """The shard's completion record if the shard is complete for this plan and undamaged, else None."""
    path = out_dir / (name + DONE_SUFFIX)
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if record.get("key") != key:
        return None
    if FileRecord.model_validate(record["file"]).problem(out_dir) is not None:
        return None
    return record


def write_done_record(out_dir: Path, shard: Path, key: str, samples: list[SampleStates], sha256: str) -> None:
    record = {
        "key": key,
        "file": FileRecord.of(shard, out_dir, sha256).model_dump(),
        "samples": [[s.sample_id, len(s.input_ids)] for s in samples],
    }
    write_text_atomic(out_dir / (shard.name + DONE_SUFFIX), json.dumps(record))


def cached_manifest(out_dir: Path, config: dict, upstream: dict) -> HiddenStateSet | None:
    manifest = HiddenStateSet.load_valid(out_dir)
    return manifest if manifest is not None and manifest.config == config and manifest.upstream == upstream else None


@contextmanager
def open_hf_backend(
    config: PipelineConfig, target: TargetModel, layer_ids: list[int], events: RunEvents, progress: ProgressCallback
) -> Iterator[ExtractionBackend]:
    """Load the target with transformers (one full weight load) and release it on exit."""
    import torch

    from eagle3_core.extraction.hf_backend import HfBackend, load_decoder, resolve_device

    device = resolve_device(config.extraction.device)
    message = f"loading {target.name} on {device}"
    progress(ProgressUpdate(phase=PHASE, stage="weight load", done=0, total=100, unit="%", message=message))
    compute_dtype = resolve_dtype(config.extraction.compute_dtype, device.type == "cuda")
    with events.weight_load(PHASE, f"{target.name} (transformers, {compute_dtype}, {device})"):
        decoder = load_decoder(target.root_path, getattr(torch, compute_dtype), device)
    progress(ProgressUpdate(phase=PHASE, stage="weight load", done=100, total=100, unit="%"))
    backend = HfBackend(decoder, layer_ids, config.extraction.batch_size, config.extraction.dtype)
    try:
        yield backend
    finally:
        backend.close()


@contextmanager
def open_backend(
    config: PipelineConfig,
    target: TargetModel,
    layer_ids: list[int],
    events: RunEvents,
    progress: ProgressCallback,
    server: Any,
    max_tokens: int,
) -> Iterator[ExtractionBackend]:
    """Start the configured backend (one full weight load, none when `server` is handed in); stop it on exit."""
    if config.extraction.backend == "hf":
        with open_hf_backend(config, target, layer_ids, events, progress) as backend:
            yield backend
    else:
        from eagle3_core.extraction.vllm_backend import open_vllm_backend

        with open_vllm_backend(config, target, layer_ids, events, progress, server, max_tokens) as backend:
            yield backend


def extract_hidden_states(
    config: PipelineConfig,
    sample_set: SampleSet,
    target: TargetModel,
    events: RunEvents,
    progress: ProgressCallback = ignore_progress,
    server: Any = None,
) -> HiddenStateSet:
    """Extract the aux and last hidden states of every training sample (of this host's slice,
    `orchestration.host`) into `<run_dir>/hidden_states/` (the slice's folder under it)."""
    out_dir = RunLayout.of(config).hidden_states
    take_folder_key(config, target, out_dir, events)
    cfg, upstream = phase_config(config, target), upstream_of(sample_set, target)
    cached = cached_manifest(out_dir, cfg, upstream)
    if cached is not None:
        events.record(PHASE, CACHE_HIT, f"hidden states at {out_dir} are complete and valid", digest=cached.digest)
        return cached

    key = sha256_json({"config": cfg, "target": upstream["target"]})
    part = host_slice(config)
    rows = [r for r in training_rows(sample_set, config.sampling.holdout_fraction) if in_slice(part, r["id"])]
    if not rows and part is None:  # a host's slice of a tiny set may be empty
        raise ValueError(f"{sample_set.root}: no ok, non-held-out samples to extract")
    shards = plan_shards(rows, cfg["extraction"]["samples_per_shard"])
    keys = [shard_key(key, s) for s in shards]
    kept_root = RunLayout.of(config).kept(out_dir)
    if brought := bring_back_shards(out_dir, kept_root, keys):
        events.record(PHASE, DECISION, f"{len(brought)} shards of these samples brought back from {kept_root}")
    pending = [i for i, k in enumerate(keys) if done_record(out_dir, shard_name(i), k) is None]
    out_dir.mkdir(parents=True, exist_ok=True)
    if pending and len(pending) < len(shards):
        events.record(
            PHASE,
            RESUME,
            f"{len(shards) - len(pending)} of {len(shards)} shards done; extracting {len(pending)}",
            pending=[shard_name(i) for i in pending],
        )
    if pending:
        layer_ids = cfg["layer_ids"]
        needed = int(
            sum(len(r["input_ids"]) for i in pending for r in shards[i])
            * bytes_per_token(target.hidden_size, config.extraction.dtype)
        )
        preflight_extraction(config, sample_set, target, out_dir, layer_ids, needed, starts_engine(server), events)
        max_tokens = max(len(r["input_ids"]) for r in rows)
        with open_backend(config, target, layer_ids, events, progress, server, max_tokens) as backend:
            # Only now, with the preflight passed and the engine up, is anything in the folder written.
            write_folder_key(out_dir, folder_key(config, target), cfg["extraction"]["samples_per_shard"])
            set_aside_replaced(out_dir, kept_root, pending)
            remove_stale(out_dir, pending)
            run_shards(backend, out_dir, shards, keys, pending, config.extraction, target.hidden_size, progress)
    write_folder_key(out_dir, folder_key(config, target), cfg["extraction"]["samples_per_shard"])
    manifest = build_manifest(out_dir, shards, keys, cfg, upstream, target)
    manifest.save()
    events.record(
        PHASE,
        DECISION,
        f"stored {manifest.samples} samples, {manifest.tokens} tokens in "
        f"{len(shards)} shards ({manifest.bytes_per_token:.0f} bytes/token)",
        digest=manifest.digest,
    )
    return manifest


def replaced_shards(kept_root: Path, shard: str) -> Path:
    """Where a complete shard of another plan (other samples in that place) is kept, by its plan key."""
    return kept_root / "shards" / shard[:32]


def set_aside_replaced(out_dir: Path, kept_root: Path, pending: list[int]) -> None:
    """Move each pending shard that is complete for another plan (its record intact) aside with its record,
    instead of writing over it: a plan that asks for it again (`bring_back_shards`) loads no weights."""
    for i in pending:
        name = shard_name(i)
        try:
            record = json.loads((out_dir / (name + DONE_SUFFIX)).read_text())
            intact = FileRecord.model_validate(record["file"]).problem(out_dir) is None
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if intact:
            aside = replaced_shards(kept_root, record["key"])
            aside.mkdir(parents=True, exist_ok=True)
            os.replace(out_dir / name, aside / name)
            os.replace(out_dir / (name + DONE_SUFFIX), aside / (name + DONE_SUFFIX))


def bring_back_shards(out_dir: Path, kept_root: Path, keys: list[str]) -> list[str]:
    """Put back each shard of this plan that was set aside for another plan (the one in its place, if complete,
    is set aside in turn); returns their names. Files only move."""
    brought = []
    for i, key in enumerate(keys):
        name, aside = shard_name(i), replaced_shards(kept_root, key)
        if done_record(out_dir, name, key) is not None or done_record(aside, name, key) is None:
            continue
        set_aside_replaced(out_dir, kept_root, [i])
        os.replace(aside / name, out_dir / name)
        os.replace(aside / (name + DONE_SUFFIX), out_dir / (name + DONE_SUFFIX))
        aside.rmdir()
        brought.append(name)
    return brought


def remove_stale(out_dir: Path, pending: list[int]) -> None:
    """Drop the completion records of shards about to be rewritten, the manifest (it is rewritten at the end)
    and temporary files of a killed writer: a crash mid-run then never leaves a record that lies."""
    (out_dir / f"{HiddenStateSet.kind}.json").unlink(missing_ok=True)
    for i in pending:
        (out_dir / (shard_name(i) + DONE_SUFFIX)).unlink(missing_ok=True)
    remove_dead_temps(out_dir)


def run_shards(
    backend: ExtractionBackend,
    out_dir: Path,
    shards: list[list[SampleRow]],
    keys: list[str],
    pending: list[int],
    extraction: ExtractionConfig,
    hidden_size: int,
    progress: ProgressCallback,
) -> None:
    """Extract the pending shards; background threads validate and write each one while the next
    shards' prefill runs (the vllm backend keeps the next shards' requests in flight meanwhile)."""
    total_samples = sum(len(shards[i]) for i in pending)
    meter = RateMeter()
    counts = {"samples": 0, "tokens": 0, "shards": 0}

    def checker(rows: list[SampleRow]):
        def check(samples: list[SampleStates]) -> None:
            for row, states in zip(rows, samples, strict=True):
                check_sample(states, row["input_ids"], hidden_size)

        return check

    def on_written(key: str):
        def done(path: Path, samples: list[SampleStates], sha256: str) -> None:
            write_done_record(out_dir, path, key, samples, sha256)
            counts["shards"] += 1

        return done

    with BackgroundShardWriter(workers=extraction.writer_threads) as writer:
        extracted = backend.extract_shards(shards[i] for i in pending)
        for i, (states, ready) in zip(pending, extracted, strict=True):
            writer.submit(
                out_dir / shard_name(i),
                states,
                extraction.dtype,
                {"plan_key": keys[i]},
                ready,
                checker(shards[i]),
                on_written(keys[i]),
            )
            counts["samples"] += len(shards[i])
            counts["tokens"] += sum(len(r["input_ids"]) for r in shards[i])
            rate = meter.rate(counts["tokens"])
            progress(
                ProgressUpdate(
                    phase=PHASE,
                    stage="samples",
                    done=counts["samples"],
                    total=total_samples,
                    unit="samples",
                    rate=rate,
                    rate_unit="tok/s",
                    eta_s=meter.eta(counts["samples"], total_samples),
                    message=f"{counts['shards']}/{len(pending)} shards written",
                )
            )
    progress(
        ProgressUpdate(
            phase=PHASE,
            stage="shards",
            done=len(pending),
            total=len(pending),
            unit="shards",
            message=f"{len(pending)} shards written",
        )
    )


def index_entry(row: SampleRow, shard: str, position: int, tokens: int) -> dict[str, Any]:
    """A sample's line in the index: where its states live, and its prompt where the sample is not that
    prompt's first response (the training validation split is by prompt); an index of one response per
    prompt is as it always was."""
    entry = {"id": row["id"], "shard": shard, "position": position, "tokens": tokens}
    return entry if row["prompt_id"] == row["id"] else {**entry, "prompt": row["prompt_id"]}


def build_manifest(
    out_dir: Path, shards: list[list[SampleRow]], keys: list[str], cfg: dict, upstream: dict, target: TargetModel
) -> HiddenStateSet:
    """Index every sample (id -> shard, position, tokens) and record the shards' digests."""
    files: list[FileRecord] = []
    index: list[dict] = []
    for i, key in enumerate(keys):
        record = done_record(out_dir, shard_name(i), key)
        if record is None:
            raise ArtifactInvalid(f"{out_dir / shard_name(i)}: missing or damaged after extraction")
        files.append(FileRecord.model_validate(record["file"]))
        expected = [r["id"] for r in shards[i]]
        stored = [sid for sid, _ in record["samples"]]
        if stored != expected:
            raise ArtifactInvalid(f"{out_dir / shard_name(i)}: holds samples {stored[:3]}..., not the plan's")
        lengths = [n for _, n in record["samples"]]
        index += [index_entry(row, shard_name(i), p, lengths[p]) for p, row in enumerate(shards[i])]
    return indexed_set(out_dir, files, index, cfg, upstream, target)


def indexed_set(
    out_dir: Path, files: list[FileRecord], index: list[dict], cfg: dict, upstream: dict, target: TargetModel
) -> HiddenStateSet:
    """Write the index (id -> shard, position, tokens) of the shards `files` and return their manifest
    (not saved)."""
    index_path = out_dir / INDEX_FILE
    write_text_atomic(index_path, json.dumps({"samples": index}))
    tokens = sum(e["tokens"] for e in index)
    shard_bytes = sum(f.bytes for f in files)
    return HiddenStateSet(
        root=str(out_dir.resolve()),
        files=[*files, FileRecord.of(index_path, out_dir)],
        config=cfg,
        upstream=upstream,
        layer_ids=cfg["layer_ids"],
        dtype=cfg["extraction"]["dtype"],
        hidden_size=target.hidden_size,
        samples=len(index),
        tokens=tokens,
        bytes_per_token=shard_bytes / tokens
        if tokens
        else bytes_per_token(target.hidden_size, cfg["extraction"]["dtype"]),
        last_state_normed=LAST_STATE_NORMED,
        backend=cfg["extraction"]["backend"],
    )
