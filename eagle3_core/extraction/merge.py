"""The one HiddenStateSet of a run extracted by `orchestration.hosts` hosts (`eagle3_core.hosts`): each host
left a finished set of its slice in `<run_dir>/hidden_states/host-<i>-of-<N>/`; the merge indexes their
shards where they lie (no shard is copied or rewritten), in the SampleSet's order, as a one-host run does,
and checks that every training sample is there exactly once."""

from __future__ import annotations

import json

from eagle3_core.artifacts import ArtifactInvalid, HiddenStateSet, SampleSet, TargetModel
from eagle3_core.config import PipelineConfig
from eagle3_core.events import DECISION, RunEvents
from eagle3_core.extraction.phase import PHASE, cached_manifest, indexed_set, phase_config, training_rows, upstream_of
from eagle3_core.hidden_states.reader import INDEX_FILE
from eagle3_core.hosts import check_each_once, every_slice
from eagle3_core.run_layout import RunLayout


def merge_slices(
    config: PipelineConfig, sample_set: SampleSet, target: TargetModel, events: RunEvents
) -> HiddenStateSet:
    """Merge every host's slice into `<run_dir>/hidden_states/` (see the module docstring)."""
    out_dir = RunLayout.of(config).hidden_states
    cfg, upstream = phase_config(config, target), upstream_of(sample_set, target)
    order = {row["id"]: n for n, row in enumerate(training_rows(sample_set, config.sampling.holdout_fraction))}
    files, index = [], []
    for part in every_slice(config.orchestration.hosts):
        folder = part.folder(out_dir)
        sliced = cached_manifest(folder, cfg, upstream)
        if sliced is None:
            raise ArtifactInvalid(f"{folder}: host {part.host} of {part.hosts} left no finished hidden states")
        shards = (record for record in sliced.files if record.path != INDEX_FILE)
        files += [record.model_copy(update={"path": f"{part.name}/{record.path}"}) for record in shards]
        entries = json.loads(sliced.path_of(INDEX_FILE).read_text())["samples"]
        index += [{**entry, "shard": f"{part.name}/{entry['shard']}"} for entry in entries]
    check_each_once(order, (entry["id"] for entry in index), f"hidden states at {out_dir}")
    index.sort(key=lambda entry: order[entry["id"]])
    manifest = indexed_set(out_dir, files, index, cfg, upstream, target)
    manifest.save()
    events.record(
        PHASE,
        DECISION,
        f"merged the hidden states of {config.orchestration.hosts} hosts: {manifest.samples} samples, "
        f"{manifest.tokens} tokens in {len(files)} shards",
        digest=manifest.digest,
    )
    return manifest
