"""Vocab mapping: counts only loss-masked tokens of training rows, round trips draft -> target -> draft,
computes coverage exactly, and never reuses a mapping counted on other data."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from eagle3_core.artifacts import SampleSet, record_files
from eagle3_core.config import PipelineConfig
from eagle3_core.events import CACHE_HIT, RunEvents
from eagle3_core.sampling.table import is_heldout, write_part
from eagle3_core.vocab import (
    StaleVocabMap,
    build_vocab_map,
    count_loss_tokens,
    coverage,
    draft_to_target,
    load_vocab_tensors,
    mapping_tensors,
    select_draft_tokens,
)
from tests.helpers.targets import VOCAB, fake_target


def sample_set(root: Path, rows: list[dict]) -> SampleSet:
    root.mkdir(parents=True, exist_ok=True)
    part = write_part([{"status": "ok", "messages": [], **r} for r in rows], root / "part-00000.parquet")
    manifest = SampleSet(root=str(root), files=record_files(root, [part]), ok=len(rows))
    manifest.save()
    return manifest


def rows_for(seed: int, count: int = 40) -> list[dict]:
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(count):
        ids = torch.randint(0, VOCAB, (12,), generator=generator).tolist()
        rows.append({"id": f"s{seed}-{i}", "input_ids": ids, "loss_mask": [0] * 4 + [1] * 8})
    return rows


def target_to_draft(target_ids: torch.Tensor, t2d: torch.Tensor) -> torch.Tensor:
    """Draft id of each target id, -1 where the token is outside the draft vocabulary."""
    draft_index = torch.cumsum(t2d.long(), 0) - 1
    return torch.where(t2d[target_ids], draft_index[target_ids], -1)


def test_counts_only_loss_masked_tokens() -> None:
    rows = [
        {"id": "a", "input_ids": [1, 2, 3, 3], "loss_mask": [0, 0, 1, 1]},
        {"id": "b", "input_ids": [2], "loss_mask": [1]},
    ]
    counts = count_loss_tokens(rows, 5)
    assert counts.tolist() == [0, 0, 1, 2, 0]


def test_selection_round_trip_and_exact_coverage() -> None:
    counts = torch.tensor([5, 0, 9, 9, 1, 7, 0, 2])
    selected = select_draft_tokens(counts, 4)
    assert selected.tolist() == [0, 2, 3, 5]  # 9, 9, 7, 5; ties by lower id
    d2t, t2d = mapping_tensors(selected, 8)
    draft_ids = torch.arange(4)
    targets = draft_to_target(draft_ids, d2t)
    assert targets.tolist() == [0, 2, 3, 5]
    assert torch.equal(target_to_draft(targets, t2d), draft_ids)
    assert target_to_draft(torch.tensor([1, 7]), t2d).tolist() == [-1, -1]
    assert coverage(counts, t2d) == 30 / 33
    assert select_draft_tokens(counts, 100).numel() == 8  # capped at the target's vocabulary


def test_build_uses_training_rows_and_refuses_other_data(tmp_path: Path) -> None:
    config = PipelineConfig(run_dir=tmp_path / "run")
    config.vocab.draft_vocab_size = 20
    config.sampling.holdout_fraction = 0.3
    events = RunEvents(config.run_dir)
    target = fake_target(tmp_path)
    rows = rows_for(0)
    samples = sample_set(tmp_path / "samples", rows)
    vocab_map = build_vocab_map(config, samples, target, events)

    training = [r for r in rows if not is_heldout(r["id"], 0.3)]
    assert 0 < len(training) < len(rows)
    counts = count_loss_tokens(training, VOCAB)
    d2t, t2d = load_vocab_tensors(vocab_map, samples.digest)
    assert vocab_map.draft_vocab_size == 20 == d2t.numel()
    assert vocab_map.coverage == int(counts[t2d].sum()) / int(counts.sum())
    assert torch.equal(t2d, mapping_tensors(select_draft_tokens(counts, 20), VOCAB)[1])

    assert build_vocab_map(config, samples, target, events).digest == vocab_map.digest
    assert events.count(CACHE_HIT, "vocab") == 1

    other = sample_set(tmp_path / "other", rows_for(1))
    with pytest.raises(StaleVocabMap, match="counted on SampleSet"):
        load_vocab_tensors(vocab_map, other.digest)
    rebuilt = build_vocab_map(config, other, target, events)
    assert rebuilt.sample_set_digest == other.digest != vocab_map.sample_set_digest
    assert events.count(CACHE_HIT, "vocab") == 1


def test_out_of_vocabulary_token_is_named() -> None:
    with pytest.raises(ValueError, match="row 'bad'"):
        count_loss_tokens([{"id": "bad", "input_ids": [1, 99], "loss_mask": [1, 1]}], 50)
