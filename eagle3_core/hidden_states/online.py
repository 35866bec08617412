"""Hidden states fed by a live engine instead of a stored set (`training.data: online`).

`OnlineDataset` has the packing, ids and items of the stored set's `reader.HiddenStateDataset` (items as
stored: bf16, or fp8 with scales), but its samples' states come from a `StatesSource` (the vLLM extraction
engine, or the transformers backend) when training needs them. `follow(plan)` wraps the training's own plan
(the item indices of each step, in the order its shuffling decides): it asks for the states of the steps
ahead, at most `prefetch` samples ahead of the step being handed out, and hands a step's indices on once its
items are in memory; each item is dropped once read. Nothing is written: the engine's own files are deleted
by the source as it reads them. With `cache_bytes` > 0, items that fit are kept for the next epochs.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from eagle3_core.hidden_states.description import StatesDescription
from eagle3_core.hidden_states.reader import pack, packed_item
from eagle3_core.hidden_states.storage import SampleRow, SampleStates, check_sample, stored_state

# Steps whose states are asked for at once: two keep the engine busy while one step's answers are collected.
FETCH_WORKERS = 2


class StatesSource(Protocol):
    """What online training asks of an engine: the states of `rows`, in order, and what to wait on before
    reading them (a CUDA event, or None). The extraction backends answer it."""

    def extract(self, rows: list[SampleRow]) -> tuple[list[SampleStates], object | None]: ...


@dataclass
class OnlineStates:
    """The input of online training: the engine (`source`), the training rows of the SampleSet in its order
    (`sampling.table.training_rows`), what their states are, the SampleSet's digest, the digest of what makes
    the engine's states what they are (extraction's content fields: training's cache key holds it), and the
    bounds (`training.online_prefetch` samples ahead, `training.online_cache_gb` as bytes)."""

    source: StatesSource
    rows: list[dict[str, Any]]
    description: StatesDescription
    sample_set: str
    key: str
    prefetch: int
    cache_bytes: int = 0


def sample_part(states: SampleStates, dtype: str, max_tokens: int) -> dict[str, torch.Tensor]:
    """One sample's tensors as a stored shard yields them undequantised (`read_sample(..., dequantize=False)`):
    `aux` [t, 3, H] / `last` [t, H] in `dtype` (fp8 with `aux_scale` [t, 3] / `last_scale` [t]), `input_ids`
    long, `loss_mask` bool; t = at most `max_tokens` tokens from the start."""
    part = {"input_ids": states.input_ids.to("cpu", torch.long), "loss_mask": states.loss_mask.to("cpu").bool()}
    for name in ("aux", "last"):
        part[name], scale = stored_state(states, name, dtype)
        if scale is not None:
            part[f"{name}_scale"] = scale
    return {name: tensor[:max_tokens] for name, tensor in part.items()}


def item_bytes(item: dict[str, torch.Tensor]) -> int:
    return sum(tensor.numel() * tensor.element_size() for tensor in item.values())


class OnlineDataset:
    """Packed sequences of states asked of a live engine (see the module docstring). Same ids, packing and
    item layout as `reader.HiddenStateDataset(..., dequantize=False)`; `sample_ids=` restricts it to those ids,
    in that order. `requested` counts the samples asked of the engine (each epoch asks again without a cache)."""

    def __init__(self, online: OnlineStates, max_length: int, sample_ids: list[str] | None = None):
        if max_length < 1:
            raise ValueError(f"max_length must be positive, got {max_length}")
        self.online = online
        self.max_length = max_length
        rows = online.rows
        self.sample_ids = [row["id"] for row in rows]
        self.prompt_ids = [row.get("prompt_id", row["id"]) for row in rows]
        if sample_ids is not None:
            by_id = {row["id"]: row for row in rows}
            missing = [s for s in sample_ids if s not in by_id]
            if missing:
                raise KeyError(f"{len(missing)} sample ids are not among the training rows, e.g. {missing[:3]}")
            rows = [by_id[s] for s in sample_ids]
        self.rows = rows
        self.truncated = sum(1 for row in rows if len(row["input_ids"]) > max_length)
        self.packs = pack([len(row["input_ids"]) for row in rows], max_length)
        self.requested = 0
        self._ready: dict[int, deque[dict[str, torch.Tensor]]] = {}
        self._cache: dict[int, dict[str, torch.Tensor]] = {}
        self._cached_bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.packs)

    def fetch(self, index: int) -> dict[str, torch.Tensor]:
        """Ask the engine for item `index`'s samples and pack them; each sample is checked against its row
        (token ids, shapes, NaN/Inf) as extraction checks what it stores."""
        rows = [self.rows[i] for i in self.packs[index]]
        with self._lock:
            self.requested += len(rows)
        states, ready = self.online.source.extract(rows)
        if ready is not None:
            ready.synchronize()
        description = self.online.description
        for row, sample in zip(rows, states, strict=True):
            check_sample(sample, row["input_ids"], description.hidden_size)
        return packed_item([sample_part(s, description.dtype, self.max_length) for s in states])

    def _keep(self, index: int, item: dict[str, torch.Tensor]) -> bool:
        """Cache `item` where it fits `cache_bytes`; whether it is cached."""
        with self._lock:
            if index in self._cache:
                return True
            size = item_bytes(item)
            if self._cached_bytes + size > self.online.cache_bytes:
                return False
            self._cache[index] = item
            self._cached_bytes += size
            return True

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        """Item `index`: from the cache, or the copy `follow` fetched for it (dropped here), else asked now."""
        with self._lock:
            if index in self._cache:
                return self._cache[index]
            waiting = self._ready.get(index)
            if waiting:
                item = waiting.popleft()
                if not waiting:
                    del self._ready[index]
                return item
        item = self.fetch(index)
        self._keep(index, item)
        return item

    def _fetched(self, index: int) -> None:
        """Fetch item `index` for a step ahead: into the cache where it fits, else held until read once."""
        if index in self._cache:
            return
        item = self.fetch(index)
        if not self._keep(index, item):
            with self._lock:
                self._ready.setdefault(index, deque()).append(item)

    def follow(self, plan: Iterator[list[int]]) -> Iterator[list[int]]:
        """The steps of `plan`, each handed on once its items are fetched; later steps are asked for while
        fewer than `prefetch` samples wait (at least the next step is always asked for)."""
        pool = ThreadPoolExecutor(max_workers=FETCH_WORKERS, thread_name_prefix="online-states")
        queued: deque[tuple[list[int], list[Future[None]], int]] = deque()
        waiting = 0  # samples of the queued steps
        try:
            steps = iter(plan)
            exhausted = False
            while True:
                while not exhausted and (not queued or waiting < self.online.prefetch):
                    indices = next(steps, None)
                    if indices is None:
                        exhausted = True
                        break
                    samples = sum(len(self.packs[i]) for i in indices)
                    queued.append((indices, [pool.submit(self._fetched, i) for i in indices], samples))
                    waiting += samples
                if not queued:
                    return
                indices, futures, samples = queued.popleft()
                for future in futures:
                    future.result()
                waiting -= samples
                yield indices
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
