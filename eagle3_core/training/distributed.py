"""Process groups under torchrun: one process per GPU (NCCL) or per CPU worker (gloo), a single process
otherwise. Replicated drafts use DDP; large drafts FSDP2 (`fully_shard`: parameters, gradients and
optimizer state sharded across ranks, gathered layer by layer)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


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


def wrap(module: nn.Module, group: Group, sharding: str) -> nn.Module:
    """DDP or FSDP2 around the objective; unchanged in a single process."""
    if not group.distributed:
        return module
    if sharding == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        # One group at the root: the draft is one layer, and its forward reads the layer's projection
        # matrices (cast once per unroll) outside the layer's own forward, so they must be gathered there.
        fully_shard(module)
        return module
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [group.device.index] if group.device.type == "cuda" else None
    # Gradients live in DDP's all-reduce buckets (no copy into and out of them each step; same values).
    return DistributedDataParallel(module, device_ids=device_ids, gradient_as_bucket_view=True)


def all_reduce_sum(tensor: torch.Tensor, group: Group) -> torch.Tensor:
    if group.distributed:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def barrier(group: Group) -> None:
    if group.distributed:
        dist.barrier()
