"""Phase 4, vocab mapping: the draft's vocabulary is the `draft_vocab_size` target tokens the draft is
trained to predict most often, counted over loss-masked (assistant) tokens of training rows only.

The mapping is stored as `d2t` (offsets: target id = draft id + d2t[draft id], the form vLLM and SGLang
read) and `t2d` (bool mask over the target vocabulary). It is keyed on the SampleSet's digest: a mapping
counted on other data would silently cap what the draft can predict, so it is never reused for new data.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from eagle3_core.artifacts import ArtifactInvalid, SampleSet, TargetModel, VocabMap, record_files
from eagle3_core.config import PipelineConfig
from eagle3_core.events import CACHE_HIT, DECISION, RunEvents
from eagle3_core.files import atomic_path
from eagle3_core.phases import VOCAB, phase_key
from eagle3_core.run_layout import RunLayout
from eagle3_core.sampling.table import iter_rows, row_heldout

PHASE = VOCAB.name
TENSOR_FILE = "vocab_map.safetensors"


class StaleVocabMap(ValueError):
    """A VocabMap counted on a different SampleSet than the data it is about to be used with."""


def count_loss_tokens(rows: Iterable[dict], vocab_size: int) -> torch.Tensor:
    """Occurrences [vocab] of each target id among tokens whose loss_mask is 1."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for row in rows:
        ids = torch.tensor(row["input_ids"], dtype=torch.int64)
        mask = torch.tensor(row["loss_mask"], dtype=torch.bool)
        if len(ids) and int(ids.max()) >= vocab_size:
            raise ValueError(f"row {row['id']!r}: token id {int(ids.max())} outside the vocabulary ({vocab_size})")
        counts += torch.bincount(ids[mask], minlength=vocab_size)
    return counts


def select_draft_tokens(counts: torch.Tensor, draft_vocab_size: int) -> torch.Tensor:
    """The `draft_vocab_size` most frequent target ids (ties and unseen tokens: lower id first), ascending."""
    size = min(draft_vocab_size, counts.numel())
    order = torch.sort(-counts, stable=True).indices  # most frequent first; stable keeps lower ids first
    return order[:size].sort().values


def mapping_tensors(selected: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Ascending target ids of the draft vocabulary -> (d2t offsets [Vd] int64, t2d mask [V] bool)."""
    d2t = selected - torch.arange(selected.numel())
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[selected] = True
    return d2t, t2d


def draft_to_target(draft_ids: torch.Tensor, d2t: torch.Tensor) -> torch.Tensor:
    return draft_ids + d2t[draft_ids]


def coverage(counts: torch.Tensor, t2d: torch.Tensor) -> float:
    """Share of loss-masked tokens inside the draft vocabulary (exact integer ratio)."""
    total = int(counts.sum())
    return int(counts[t2d].sum()) / total if total else 0.0


def phase_config(config: PipelineConfig, target: TargetModel) -> dict:
    """The fields marked content and the draft vocabulary size as capped at the target's."""
    return {**phase_key(config, VOCAB), "draft_vocab_size": min(config.vocab.draft_vocab_size, target.vocab_size)}


def load_vocab_tensors(vocab_map: VocabMap, sample_set_digest: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) of a mapping, refused unless it was counted on the SampleSet with this digest."""
    if vocab_map.sample_set_digest != sample_set_digest:
        raise StaleVocabMap(
            f"vocab map at {vocab_map.root} was counted on SampleSet {vocab_map.sample_set_digest[:12]}, "
            f"not on {sample_set_digest[:12]}: rebuild it (eagle3 vocab)"
        )
    vocab_map.validate()
    tensors = load_file(vocab_map.path_of(TENSOR_FILE))
    return tensors["d2t"], tensors["t2d"]


def cached_vocab_map(out_dir: Path, cfg: dict, upstream: dict, events: RunEvents) -> VocabMap | None:
    """The stored mapping if it was made from this config and these inputs and its file is intact."""
    path = out_dir / f"{VocabMap.kind}.json"
    if not path.exists():
        return None
    try:
        stored = VocabMap.load(path)
    except (ValueError, ArtifactInvalid) as exc:
        events.record(PHASE, DECISION, f"rebuilding vocab map: unreadable manifest ({exc})")
        return None
    if stored.upstream != upstream or stored.config != cfg:
        events.record(PHASE, DECISION, "rebuilding vocab map: it was built from other data or settings")
        return None
    if not stored.is_valid():
        events.record(PHASE, DECISION, "rebuilding vocab map: its tensor file is missing or changed")
        return None
    return stored


def build_vocab_map(config: PipelineConfig, sample_set: SampleSet, target: TargetModel, events: RunEvents) -> VocabMap:
    """Count, select, and write `<run_dir>/vocab/` (tensors + manifest); reuse only an exact match."""
    out_dir = RunLayout.of(config).vocab
    cfg = phase_config(config, target)
    upstream = {"sample_set": sample_set.digest, "target": target.digest}
    cached = cached_vocab_map(out_dir, cfg, upstream, events)
    if cached is not None:
        events.record(PHASE, CACHE_HIT, f"vocab map at {out_dir} matches its inputs", digest=cached.digest)
        return cached
    rows = (r for r in iter_rows(sample_set, "ok") if not row_heldout(r, config.sampling.holdout_fraction))
    counts = count_loss_tokens(rows, target.vocab_size)
    d2t, t2d = mapping_tensors(select_draft_tokens(counts, cfg["draft_vocab_size"]), target.vocab_size)
    tensor_path = out_dir / TENSOR_FILE
    out_dir.mkdir(parents=True, exist_ok=True)
    with atomic_path(tensor_path) as tmp:
        save_file({"d2t": d2t, "t2d": t2d, "counts": counts}, str(tmp))
    vocab_map = VocabMap(
        root=str(out_dir.resolve()),
        files=record_files(out_dir, [tensor_path]),
        config=cfg,
        upstream=upstream,
        draft_vocab_size=int(d2t.numel()),
        target_vocab_size=target.vocab_size,
        coverage=coverage(counts, t2d),
        sample_set_digest=sample_set.digest,
    )
    vocab_map.save()
    events.record(
        PHASE,
        DECISION,
        f"draft vocabulary of {vocab_map.draft_vocab_size} tokens covers {vocab_map.coverage:.2%} of "
        f"{int(counts.sum())} loss-masked tokens",
        digest=vocab_map.digest,
    )
    return vocab_map
