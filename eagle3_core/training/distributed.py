"""Process groups under torchrun: one process per GPU (NCCL) or per CPU worker (gloo), a single process
otherwise. Replicated drafts use DDP; large drafts FSDP2 (`fully_shard`: parameters, gradients and
optimizer state sharded across ranks, gathered layer by layer).

Under DDP the draft layer's projection gradients are all-reduced by `LayerGradientSync`, not by DDP's
buckets: the layer's weights are cast to bf16 once per unroll, and autograd runs that cast's backward (the
fp32 gradient DDP waits for) only at the very end of backward, after every step's layer, attention and fc
backward, so ~0.9 GB of all-reduce could not overlap anything. As gradient leaves instead, each matrix's
gradient is complete (and its all-reduce starts) as soon as step 0's backward has passed it.
"""

from __future__ import annotations

import gc
import importlib
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from eagle3_core.draft.model import DraftLayer, Weights

WeightRegion = tuple[list[nn.Parameter], dict[str, slice]]
"""Parameters stacked by rows into one [rows, cols] matrix, and the `Weights` entries filling its columns."""


@dataclass(frozen=True)
class Group:
    rank: int
    world: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    if name == "auto":
        return torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    if name == "cuda":
        return torch.device(f"cuda:{local_rank}")
    return torch.device(name)


def init_group(device_name: str) -> Group:
    """Join torchrun's process group when WORLD_SIZE > 1 (nccl on GPUs, gloo on CPUs)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(device_name, local_rank)
    if world > 1 and not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    return Group(rank=rank, world=world, device=device)


# torch's process-wide caches that keep a DeviceMesh (so its process group) after the group is destroyed:
# (module, function whose `cache_clear` empties it); those a torch version lacks are skipped.
DTENSOR_CACHES = (
    ("torch.distributed.tensor.debug", "_clear_sharding_prop_cache"),
    ("torch.distributed.tensor._redistribute", "clear_redistribute_planner_cache"),
    ("torch.distributed.tensor._redistribute", "_gen_transform_infos.cache_clear"),
    ("torch.distributed.tensor._collective_utils", "MeshTopoInfo.build_from_mesh.cache_clear"),
)


def clear_dtensor_caches() -> None:
    for module_name, path in DTENSOR_CACHES:
        target: object = importlib.import_module(module_name)
        for name in path.split("."):
            target = getattr(target, name, None)
        if callable(target):
            target()


def leave_group(group: Group) -> None:
    """Tear torchrun's process group down now, while the interpreter is whole.

    `destroy_process_group` alone does not under FSDP2: DTensor's caches keep the DeviceMesh, the mesh
    keeps the group, and gloo's threads (NCCL's communicators) and rank 0's rendezvous-store server then
    die during interpreter shutdown, in no set order. Rank 0 aborted there ("terminate called without an
    active exception") in about 1 of 150 two-process runs, after training had finished, and torchrun
    reports such a rank as failed. Call it once the phase's models are released."""
    if not group.distributed or not dist.is_initialized():
        return
    dist.destroy_process_group()
    clear_dtensor_caches()
    gc.collect()  # the FSDP module's reference cycles, so the group's last reference goes now


@contextmanager
def process_group(device_name: str) -> Iterator[Group]:
    """`init_group` for the span of a block; `leave_group` when it ends (raised or not) if the block
    joined the group. Objects made in the block hold the group: build them in a function it calls. Import
    the training modules before: torch.distributed.nn.functional, first imported inside, keeps the world
    group as its functions' default argument."""
    joined = not dist.is_initialized()
    group = init_group(device_name)
    try:
        yield group
    finally:
        if joined:
            leave_group(group)


@dataclass
class _Region:
    params: list[nn.Parameter]  # stacked by rows into `buffer`
    columns: dict[str, slice]  # Weights entry -> its columns of `buffer`
    buffer: torch.Tensor  # [rows, cols] fp32: the params' gradients (param.grad are row views of it)
    filled: set[str] = field(default_factory=set)


class LayerGradientSync:
    """DDP's gradient all-reduce for the draft layer's projection matrices (the unroll's `gradient_sync`),
    started per matrix as soon as its gradient is complete.

    Per forward, the cast `Weights` become autograd leaves; a leaf's gradient accumulator runs as soon as
    its last contribution (step 0's) arrives (accumulators have the engine's top priority), and its hook
    copies the summed bf16 gradient into the fp32 buffer (= the cast's backward), divides by the world size
    and all-reduces the region asynchronously once all its columns are in (DDP's order: divide, then sum).
    At the end of backward the parameters' `.grad` are the reduced buffers, as plain DDP leaves them.
    One backward per optimizer step: gradients are overwritten, not accumulated (the training loop)."""

    def __init__(self, layout: list[WeightRegion], process_group: dist.ProcessGroup | None, world: int):
        self.regions = [
            _Region(params, columns, torch.empty(sum(p.shape[0] for p in params), params[0].shape[1]).to(params[0]))
            for params, columns in layout
        ]
        self.process_group, self.world = process_group, world
        self.works: list[dist.Work] = []

    def __call__(self, weights: Weights) -> Weights:
        """Cast weights -> the same values as gradient leaves whose hooks reduce their gradients."""
        leaves = Weights(weights)
        self.works = []
        for region in self.regions:
            if any(p.grad is not None for p in region.params):
                raise RuntimeError("LayerGradientSync: gradients not cleared since the last step (zero_grad)")
            region.filled = set()
            for name in region.columns:
                leaves[name] = weights[name].detach().requires_grad_()
                leaves[name].register_post_accumulate_grad_hook(partial(self._on_gradient, region, name))
        return leaves

    def _on_gradient(self, region: _Region, name: str, leaf: torch.Tensor) -> None:
        if not any(r.filled for r in self.regions):  # first gradient of this backward
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        region.buffer[:, region.columns[name]].copy_(leaf.grad)  # bf16 -> fp32, as the cast's backward
        leaf.grad = None
        region.filled.add(name)
        if region.filled == set(region.columns):
            region.buffer.div_(self.world)
            self.works.append(dist.all_reduce(region.buffer, group=self.process_group, async_op=True))

    def _finish(self) -> None:
        """End of backward: wait for the all-reduces, hand the buffers' rows to the parameters."""
        for work in self.works:
            work.wait()
        for region in self.regions:
            rows = region.buffer.split([p.shape[0] for p in region.params])
            for param, grad in zip(region.params, rows, strict=True):
                param.grad = grad


def projection_layout(layer: DraftLayer) -> list[WeightRegion]:
    """Where each `Weights` entry's gradient lands: the first projection's (gate/up) rows stacked as in
    the fused matrix, the embedding and hidden halves of the first projection its column halves."""
    attn, mlp = layer.self_attn, layer.mlp
    first = attn.first_projection()
    half = first[0].shape[1] // 2
    return [
        (first, {"qkv_embed": slice(0, half), "qkv_hidden": slice(half, 2 * half)}),
        *(([weight], {name: slice(None)}) for name, weight in attn.inner_weights().items()),
        ([mlp.gate_proj.weight, mlp.up_proj.weight], {"gate_up": slice(None)}),
        ([mlp.down_proj.weight], {"down_proj": slice(None)}),
    ]


def early_gradient_sync(module: nn.Module, layer: DraftLayer) -> list[str]:
    """Install a `LayerGradientSync` for `layer` (the draft layer inside `module`, the objective, whose
    unroll hands it the cast weights); the names of the parameters it reduces, for DDP to ignore. Ranks
    start from rank 0's values, as DDP's own do."""
    layout = projection_layout(layer)
    process_group = dist.new_group()
    for params, _ in layout:
        for param in params:
            dist.broadcast(param.data, 0, group=process_group)
    module.gradient_sync = LayerGradientSync(layout, process_group, dist.get_world_size())
    names = {id(p): n for n, p in module.named_parameters()}
    return [names[id(p)] for params, _ in layout for p in params]


def wrap(module: nn.Module, group: Group, sharding: str, early_sync_layer: nn.Module | None = None) -> nn.Module:
    """DDP or FSDP2 around the objective; unchanged in a single process. `early_sync_layer` (DDP): the
    draft layer whose projection gradients `LayerGradientSync` reduces instead of DDP's buckets."""
    if not group.distributed:
        return module
    if sharding == "fsdp2":  # gathers and reduce-scatters per root group; no early sync
        from torch.distributed.fsdp import fully_shard

        # One group at the root: the draft is one layer, and its forward reads the layer's projection
        # matrices (cast once per unroll) outside the layer's own forward, so they must be gathered there.
        fully_shard(module)
        return module
    from torch.nn.parallel import DistributedDataParallel

    if early_sync_layer is not None:
        ignored = early_gradient_sync(module, early_sync_layer)
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, ignored)
    device_ids = [group.device.index] if group.device.type == "cuda" else None
    # Gradients live in DDP's all-reduce buckets (no copy into and out of them each step; same values).
    # The buffers (d2t, t2d) never change: no broadcast before every forward.
    return DistributedDataParallel(module, device_ids=device_ids, gradient_as_bucket_view=True, broadcast_buffers=False)


def all_reduce_sum(tensor: torch.Tensor, group: Group) -> torch.Tensor:
    if group.distributed:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def barrier(group: Group) -> None:
    if group.distributed:
        dist.barrier()
