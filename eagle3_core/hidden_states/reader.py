"""The training side of hidden-state storage: a torch Dataset of packed sequences read from the shards.

Samples are packed in order, whole, into sequences of at most `max_length` tokens (document boundaries kept
through `position_ids`, restarting at 0 per sample, and `document_ids`). The packing plan is built from the
index alone; each item memory-maps only the shards its samples live in (`safe_open` + slices), so the
dataset never holds more than one packed sequence of states in memory, whatever the size on disk.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

import torch
from safetensors import safe_open
from torch.utils.data import Dataset

from eagle3_core.artifacts import HiddenStateSet
from eagle3_core.hidden_states.storage import read_sample

log = logging.getLogger("eagle3")
INDEX_FILE = "index.json"


@dataclass(frozen=True)
class IndexEntry:
    """Where one sample's states live: shard file (relative to the set's root), position, token count;
    and the prompt it answers (its own id where the index names none: the prompt's first response)."""

    sample_id: str
    shard: str
    position: int
    tokens: int
    prompt_id: str


def load_index(hidden_states: HiddenStateSet) -> list[IndexEntry]:
    """The set's samples in stored order."""
    data = json.loads(hidden_states.path_of(INDEX_FILE).read_text())
    return [
        IndexEntry(e["id"], e["shard"], e["position"], e["tokens"], e.get("prompt", e["id"])) for e in data["samples"]
    ]


def pack(lengths: list[int], max_length: int) -> list[list[int]]:
    """Greedy in-order packing of sample indices into sequences of at most `max_length` tokens; a sample
    longer than `max_length` fills a sequence on its own (it is truncated when read)."""
    packs: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i, length in enumerate(lengths):
        length = min(length, max_length)
        if current and used + length > max_length:
            packs.append(current)
            current, used = [], 0
        current.append(i)
        used += length
    if current:
        packs.append(current)
    return packs


class HiddenStateDataset(Dataset):
    """Packed sequences of hidden states for draft training.

    Item: `aux` [T, 3, H] float32, `last` [T, H] float32, `input_ids` [T] long, `loss_mask` [T] bool,
    `position_ids` [T] long (0 at each sample's start), `document_ids` [T] long (0, 1, ... within the item),
    with T <= max_length. `sample_ids` lists every sample of the set in stored order, `prompt_ids` the prompt
    of each (for train/validation splits by prompt); `sample_ids=` restricts the dataset to those ids, in
    that order. `truncated` counts samples longer than `max_length` (kept, cut to `max_length`).
    `dequantize=False`: `aux`/`last` as stored (bf16, or fp8 with `aux_scale` [T, 3] / `last_scale` [T]), for
    the training loop to dequantise on its device (`dequantize_states`: the same float32 values, from a half
    or quarter of the bytes to copy).
    """

    def __init__(
        self,
        hidden_states: HiddenStateSet,
        max_length: int,
        sample_ids: list[str] | None = None,
        dequantize: bool = True,
    ):
        if max_length < 1:
            raise ValueError(f"max_length must be positive, got {max_length}")
        # Sizes of every file, and a re-hash of any whose mtime changed: a shard damaged after it was
        # written raises ArtifactInvalid here instead of being trained on.
        hidden_states.validate()
        self.hidden_states = hidden_states
        self.max_length = max_length
        self.dequantize = dequantize
        entries = load_index(hidden_states)
        self.sample_ids = [e.sample_id for e in entries]
        self.prompt_ids = [e.prompt_id for e in entries]
        by_id = {e.sample_id: e for e in entries}
        if sample_ids is not None:
            missing = [s for s in sample_ids if s not in by_id]
            if missing:
                raise KeyError(f"{len(missing)} sample ids are not in the hidden-state set, e.g. {missing[:3]}")
            entries = [by_id[s] for s in sample_ids]
        self.entries = entries
        self.truncated = sum(1 for e in entries if e.tokens > max_length)
        if self.truncated:
            log.warning("%d samples are longer than max_length=%d and are truncated", self.truncated, max_length)
        self.packs = pack([e.tokens for e in entries], max_length)
        self._offsets: dict[str, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self.packs)

    def _shard_offsets(self, handle, shard: str) -> torch.Tensor:
        if shard not in self._offsets:
            self._offsets[shard] = handle.get_tensor("offsets")
        return self._offsets[shard]

    def _read(self, entry: IndexEntry) -> dict[str, torch.Tensor]:
        with safe_open(str(self.hidden_states.path_of(entry.shard)), framework="pt") as handle:
            offsets = self._shard_offsets(handle, entry.shard)
            return read_sample(handle, offsets, entry.position, self.max_length, self.dequantize)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return packed_item([self._read(self.entries[i]) for i in self.packs[index]])


def packed_item(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One packed sequence of the samples `parts` (each `aux` [t, 3, H], `last` [t, H], `input_ids`,
    `loss_mask` [t], fp8 scales where stored): their tensors concatenated along tokens, with `position_ids`
    restarting at 0 per sample and `document_ids` 0, 1, ... per sample."""
    item = {name: torch.cat([p[name] for p in parts]) for name in parts[0]}
    item["position_ids"] = torch.cat([torch.arange(len(p["input_ids"])) for p in parts])
    item["document_ids"] = torch.cat(
        [torch.full((len(p["input_ids"]),), doc, dtype=torch.long) for doc, p in enumerate(parts)]
    )
    return item
