"""HiddenStateDataset: packing with document boundaries, truncation counted, subsets, damage detected."""

from __future__ import annotations

import pytest
import torch

from eagle3_core.artifacts import ArtifactInvalid
from eagle3_core.hidden_states.reader import HiddenStateDataset, pack
from tests.helpers.hidden_state_sets import H, make_set


def test_pack_keeps_samples_whole_and_in_order():
    assert pack([3, 4, 2, 6, 1], 7) == [[0, 1], [2], [3, 4]]
    assert pack([10, 2], 4) == [[0], [1]]


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_items_pack_documents_with_restarting_positions(tmp_path, dtype):
    ds = HiddenStateDataset(make_set(tmp_path, [3, 4, 2, 6], dtype), max_length=8)
    assert ds.sample_ids == ["s0", "s1", "s2", "s3"]
    assert len(ds) == 2
    first = ds[0]  # s0 (3 tokens) + s1 (4 tokens)
    assert first["position_ids"].tolist() == [0, 1, 2, 0, 1, 2, 3]
    assert first["document_ids"].tolist() == [0, 0, 0, 1, 1, 1, 1]
    assert first["input_ids"].tolist() == [0, 1, 2, 100, 101, 102, 103]
    assert first["aux"].shape == (7, 3, H) and first["aux"].dtype == torch.float32
    expected = torch.tensor([0, 1, 2, 100, 101, 102, 103], dtype=torch.float32)
    tolerance = 0.07 * expected.abs() + 1e-6  # fp8 rounds to 3 mantissa bits
    assert torch.all((first["last"][:, 0] - expected).abs() <= tolerance)
    assert first["loss_mask"].dtype == torch.bool


def test_long_samples_are_truncated_and_counted(tmp_path):
    ds = HiddenStateDataset(make_set(tmp_path, [3, 12, 2]), max_length=5)
    assert ds.truncated == 1
    assert [len(ds[i]["input_ids"]) for i in range(len(ds))] == [3, 5, 2]
    assert ds[1]["input_ids"].tolist() == [100, 101, 102, 103, 104]


def test_sample_ids_select_and_order_a_subset(tmp_path):
    ds = HiddenStateDataset(make_set(tmp_path, [3, 4, 2, 6]), max_length=100, sample_ids=["s3", "s0"])
    assert len(ds) == 1
    assert ds[0]["input_ids"].tolist() == [300, 301, 302, 303, 304, 305, 0, 1, 2]
    with pytest.raises(KeyError):
        HiddenStateDataset(make_set(tmp_path, [3]), max_length=8, sample_ids=["nope"])


def test_a_damaged_shard_is_never_read(tmp_path):
    hidden = make_set(tmp_path, [3, 4, 2, 6])
    shard = tmp_path / "shard-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0xFF  # same size, different content
    shard.write_bytes(bytes(data))
    with pytest.raises(ArtifactInvalid, match="sha256"):
        HiddenStateDataset(hidden, max_length=8)
    shard.write_bytes(bytes(data[:-100]))
    with pytest.raises(ArtifactInvalid, match="size"):
        HiddenStateDataset(hidden, max_length=8)
