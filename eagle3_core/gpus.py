"""The host's CUDA GPUs as nvidia-smi sees them, without importing torch: whether there are any, their model
and memory, and which processes hold their memory. A foundation: serving waits on it, preflight, the dtype
choice and the hardware's server defaults (`devices`) read it."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass


def has_cuda_gpus() -> bool:
    return shutil.which("nvidia-smi") is not None and gpu_compute_apps() is not None


def nvidia_smi(query: str) -> str | None:
    """nvidia-smi's CSV answer (no header, no units) to one `--query-...=fields` option; None where it cannot
    run (no GPU, no driver)."""
    try:
        command = ["nvidia-smi", query, "--format=csv,noheader,nounits"]
        return subprocess.run(command, capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def gpu_compute_apps() -> dict[int, int] | None:
    """pid -> MiB for every process holding GPU memory (nvidia-smi), or None where there is no GPU."""
    out = nvidia_smi("--query-compute-apps=pid,used_memory")
    return None if out is None else parse_compute_apps(out)


def parse_compute_apps(text: str) -> dict[int, int]:
    apps: dict[int, int] = {}
    for line in text.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) == 2 and fields[0].isdigit():
            apps[int(fields[0])] = int(fields[1]) if fields[1].isdigit() else 0
    return apps


@dataclass(frozen=True)
class GpuInfo:
    """One GPU as nvidia-smi names it: its model, its memory, the driver that runs it, its compute capability."""

    name: str
    memory_bytes: int
    driver: str
    compute_capability: float | None


def query_gpus() -> list[GpuInfo]:
    """Every GPU nvidia-smi lists (not narrowed by CUDA_VISIBLE_DEVICES); [] where there is none."""
    out = nvidia_smi("--query-gpu=name,memory.total,driver_version,compute_cap")
    return [] if out is None else parse_gpus(out)


def parse_gpus(text: str) -> list[GpuInfo]:
    """nvidia-smi's `name, memory.total (MiB), driver_version, compute_cap` lines -> GpuInfo each (a
    compute capability nvidia-smi cannot tell, `[N/A]`, is None)."""
    gpus = []
    for line in text.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) == 4 and fields[1].isdigit():
            capability = float(fields[3]) if fields[3].replace(".", "", 1).isdigit() else None
            gpus.append(GpuInfo(fields[0], int(fields[1]) * 2**20, fields[2], capability))
    return gpus
