"""Which items each optimizer step reads, and how they reach the device.

The data position is the optimizer step: epoch e's order is a permutation seeded by (seed, e), padded so
every rank runs the same number of steps, and step s reads batch s % steps_per_epoch of epoch
s // steps_per_epoch, whatever step a run starts at (`step_batches`). Items are packed sequences
(`hidden_states.reader.HiddenStateDataset`): a batch pads them to one length, padding being its own document
that is never scored (`collate_host`). The GPU never waits on the host: a background thread reads and
collates the next batches and copies them on a side stream (`BatchPrefetcher`).
"""

from __future__ import annotations

import math
import queue
import threading
from collections.abc import Iterator, Sequence

import torch

from eagle3_core.hidden_states.storage import dequantize_states
from eagle3_core.training.distributed import Group
from eagle3_core.training.flash_ttt import document_starts
from eagle3_core.training.loss import scored_rows

Dataset = Sequence[dict[str, torch.Tensor]]


def epoch_steps(num_items: int, batch_size: int, world: int) -> int:
    """Steps of one epoch: every rank runs the same count, `batch_size` items a rank a step."""
    return math.ceil(num_items / (batch_size * world))


def run_steps(steps_per_epoch: int, max_steps: int, epochs: float) -> int:
    """Steps of a run: `training.max_steps` where set, else `epochs` of `steps_per_epoch`."""
    return max_steps or math.ceil(epochs * steps_per_epoch)


def rank_batches(num_items: int, batch_size: int, group: Group, seed: int, epoch: int | None) -> list[list[int]]:
    """This rank's batches of item indices: epoch `epoch`'s seeded permutation (None: stored order),
    padded by wrapping so every rank runs the same number of steps."""
    if epoch is None:
        order = list(range(num_items))
    else:
        order = torch.randperm(num_items, generator=torch.Generator().manual_seed(seed * 100_003 + epoch)).tolist()
    per_step = batch_size * group.world
    steps = epoch_steps(num_items, batch_size, group.world)
    padded = (order * math.ceil(steps * per_step / num_items))[: steps * per_step]
    mine = padded[group.rank :: group.world]
    return [mine[i * batch_size : (i + 1) * batch_size] for i in range(steps)]


def step_batches(
    num_items: int, batch_size: int, group: Group, seed: int, steps_per_epoch: int, start: int, stop: int
) -> Iterator[list[int]]:
    """Item indices of steps `start` .. `stop - 1`: step s reads batch s % steps_per_epoch of epoch
    s // steps_per_epoch (`rank_batches`), whatever step a run starts at."""
    order_epoch, batches = None, []
    for step in range(start, stop):
        epoch, index = divmod(step, steps_per_epoch)
        if order_epoch != epoch:
            order_epoch, batches = epoch, rank_batches(num_items, batch_size, group, seed, epoch)
        yield batches[index]


def followed(data: Dataset, plan: Iterator[list[int]]) -> Iterator[list[int]]:
    """`plan` through the dataset's own `follow` where it has one (`hidden_states.online.OnlineDataset`: the
    states of the next steps are asked for ahead of them, in this very order); else `plan` itself."""
    follow = getattr(data, "follow", None)
    return follow(plan) if follow is not None else plan


def collate_host(
    items: list[dict[str, torch.Tensor]],
    pad_multiple: int,
    ttt_steps: int | None = None,
    pin: bool = False,
    loss_on_prompt: bool = False,
) -> dict[str, torch.Tensor]:
    """Stack packed sequences into host tensors [B, T, ...] (T rounded up to `pad_multiple`; pinned with
    `pin`); padding is its own document (id -1) with loss_mask 0 (and fp8 scale 0), so it is never scored
    and never seen by real tokens. States stay in the items' dtype. With `ttt_steps`, also the scored rows
    of every step (`valid`, `scored`: `scored_rows`) and the documents' `document_starts` (flash attention);
    `loss_on_prompt` (training only: `training.loss_on_prompt`) scores every real token, not only the
    loss-masked (assistant) ones."""
    length = max(len(item["input_ids"]) for item in items)
    length = math.ceil(length / pad_multiple) * pad_multiple
    batch = {}
    for name, first in items[0].items():
        fill = -1 if name == "document_ids" else 0
        stacked = torch.full((len(items), length, *first.shape[1:]), fill, dtype=first.dtype, pin_memory=pin)
        for row, item in enumerate(items):
            stacked[row, : len(item[name])] = item[name]
        batch[name] = stacked  # [B, T, ...]
    if ttt_steps is not None:
        scored_mask = batch["document_ids"] >= 0 if loss_on_prompt else batch["loss_mask"]  # [B, T]
        valid, scored = scored_rows(scored_mask, batch["document_ids"], ttt_steps)  # [K, B, T], [N, 3]
        starts = document_starts(batch["document_ids"])  # [n + 1]
        batch["valid"], batch["scored"], batch["document_starts"] = (
            t.pin_memory() if pin else t for t in (valid, scored, starts)
        )
    return batch


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """Copy a host batch to `device` (asynchronous from pinned memory) and dequantise its states there
    (`dequantize_states`: float32 `aux` [B, T, 3, H] / `last` [B, T, H], the same values as on the CPU)."""
    return dequantize_states({name: tensor.to(device, non_blocking=True) for name, tensor in batch.items()})


def collate(
    items: list[dict[str, torch.Tensor]], device: torch.device, pad_multiple: int, ttt_steps: int | None = None
) -> dict[str, torch.Tensor]:
    """`collate_host` then `to_device`: the batch of `items` on `device`, states float32."""
    return to_device(collate_host(items, pad_multiple, ttt_steps), device)


class BatchPrefetcher:
    """The batches of `plan` (item indices per step), made ahead of the GPU by a background thread: items
    read and collated on the host (pinned on CUDA), copied and dequantised on a side stream. `next()` makes
    the current stream wait for that copy (no host wait) and returns the batch; a failure in the thread is
    raised there. Up to `depth` batches are ready ahead; `loss_on_prompt`: `collate_host`'s."""

    def __init__(
        self,
        data: Dataset,
        plan: Iterator[list[int]],
        device: torch.device,
        pad_multiple: int,
        ttt_steps: int,
        depth: int = 2,
        loss_on_prompt: bool = False,
    ):
        self.device = device
        self.ready: queue.Queue = queue.Queue(maxsize=depth)
        self.closed = threading.Event()
        self.loss_on_prompt = loss_on_prompt
        self.thread = threading.Thread(
            target=self._produce, args=(data, plan, pad_multiple, ttt_steps), name="batch-prefetch", daemon=True
        )
        self.thread.start()

    def _produce(self, data: Dataset, plan: Iterator[list[int]], pad_multiple: int, ttt_steps: int) -> None:
        try:
            cuda = self.device.type == "cuda"
            stream = torch.cuda.Stream(self.device) if cuda else None
            for indices in plan:
                if self.closed.is_set():
                    return
                items = [data[i] for i in indices]
                batch = collate_host(items, pad_multiple, ttt_steps, pin=cuda, loss_on_prompt=self.loss_on_prompt)
                if stream is None:
                    self._put((to_device(batch, self.device), None))
                    continue
                with torch.cuda.stream(stream):
                    batch = to_device(batch, self.device)
                    copied = torch.cuda.Event()
                    copied.record(stream)
                self._put((batch, copied))
        except BaseException as exc:  # handed to the training thread, which raises it
            self._put(exc)

    def _put(self, item) -> None:
        while not self.closed.is_set():
            try:
                self.ready.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def next(self) -> dict[str, torch.Tensor]:
        item = self.ready.get()
        if isinstance(item, BaseException):
            raise item
        batch, copied = item
        if copied is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(copied)
            for tensor in batch.values():
                tensor.record_stream(current)  # made on the side stream, used (and freed) on this one
        return batch

    def close(self) -> None:
        self.closed.set()
        self.thread.join()

    def __enter__(self) -> BatchPrefetcher:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
