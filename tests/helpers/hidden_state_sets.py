"""Hidden-state sets written to a temporary folder with known contents."""

from __future__ import annotations

import json

import torch

from eagle3_core.artifacts import FileRecord, HiddenStateSet
from eagle3_core.hidden_states.reader import INDEX_FILE
from eagle3_core.hidden_states.storage import SampleStates, write_shard

H = 16


def states(sample_id: str, tokens: int, base: float) -> SampleStates:
    # Every value encodes (sample, token) so a read from the wrong rows is visible.
    rows = base + torch.arange(tokens, dtype=torch.float32)  # [T]
    return SampleStates(
        sample_id=sample_id,
        input_ids=torch.arange(tokens) + int(base),
        loss_mask=torch.ones(tokens, dtype=torch.int8),
        aux=rows[:, None, None].expand(tokens, 3, H).clone(),
        last=rows[:, None].expand(tokens, H).clone(),
    )


def make_set(tmp_path, lengths: list[int], dtype: str = "bf16", per_shard: int = 2) -> HiddenStateSet:
    samples = [states(f"s{i}", n, 100.0 * i) for i, n in enumerate(lengths)]
    files, index = [], []
    for j in range(0, len(samples), per_shard):
        name = f"shard-{j // per_shard:05d}.safetensors"
        write_shard(tmp_path / name, samples[j : j + per_shard], dtype, {})
        files.append(FileRecord.of(tmp_path / name, tmp_path))
        index += [
            {"id": s.sample_id, "shard": name, "position": p, "tokens": len(s.input_ids)}
            for p, s in enumerate(samples[j : j + per_shard])
        ]
    (tmp_path / INDEX_FILE).write_text(json.dumps({"samples": index}))
    files.append(FileRecord.of(tmp_path / INDEX_FILE, tmp_path))
    return HiddenStateSet(
        root=str(tmp_path),
        files=files,
        layer_ids=[2, 4, 5],
        dtype=dtype,
        hidden_size=H,
        samples=len(samples),
        tokens=sum(lengths),
    )
