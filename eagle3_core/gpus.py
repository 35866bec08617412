"""The host's CUDA GPUs as nvidia-smi sees them, without importing torch: whether there are any, and which
processes hold their memory. A foundation: serving waits on it, preflight and the dtype choice read it."""

from __future__ import annotations

import shutil
import subprocess


def has_cuda_gpus() -> bool:
    return shutil.which("nvidia-smi") is not None and gpu_compute_apps() is not None


def gpu_compute_apps() -> dict[int, int] | None:
    """pid -> MiB for every process holding GPU memory (nvidia-smi), or None where there is no GPU."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_compute_apps(out)


def parse_compute_apps(text: str) -> dict[int, int]:
    apps: dict[int, int] = {}
    for line in text.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) == 2 and fields[0].isdigit():
            apps[int(fields[0])] = int(fields[1]) if fields[1].isdigit() else 0
    return apps
