"""The GPU memory-release check after a stop (`gpus.gpu_compute_apps` + `processes.wait_gpu_release`) against
a process that holds GPU memory and is killed: on CPU through a stand-in `nvidia-smi` that lists a live
process as holding 1024 MiB, and on a CUDA host (the lent H200) against a real torch allocation."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from eagle3_core import gpus
from eagle3_core.serving.processes import ServerError, kill_tree, wait_gpu_release

HOLDER = "import time, torch; x = torch.empty(2**28, device='cuda'); print('ready', flush=True); time.sleep(600)"


def start_holder(code: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def kill(proc: subprocess.Popen) -> set[int]:
    pids, _ = kill_tree(proc.pid, os.getpgid(proc.pid), psutil.Process(proc.pid).create_time(), grace_s=0)
    return pids


@pytest.fixture
def fake_nvidia_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An `nvidia-smi` on PATH that reports every live pid listed in the returned file as holding 1024 MiB."""
    holders = tmp_path / "holders"
    holders.write_text("")
    script = tmp_path / "bin" / "nvidia-smi"
    script.parent.mkdir()
    listing = f'for pid in $(cat {holders}); do [ -d /proc/$pid ] && echo "$pid, 1024"; done'
    script.write_text(f"#!/bin/sh\n{listing}\nexit 0\n")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{script.parent}{os.pathsep}{os.environ['PATH']}")
    return holders


def test_release_of_a_killed_holder_is_seen(fake_nvidia_smi: Path) -> None:
    proc = start_holder("import time; print('ready', flush=True); time.sleep(600)")
    fake_nvidia_smi.write_text(str(proc.pid))
    assert gpus.has_cuda_gpus()
    assert gpus.gpu_compute_apps() == {proc.pid: 1024}
    pids = kill(proc)
    wait_gpu_release(pids, timeout_s=10)
    assert gpus.gpu_compute_apps() == {}


def test_a_live_holder_fails_the_wait_by_pid(fake_nvidia_smi: Path) -> None:
    proc = start_holder("import time; print('ready', flush=True); time.sleep(600)")
    fake_nvidia_smi.write_text(str(proc.pid))
    try:
        with pytest.raises(ServerError, match=rf"pid {proc.pid} \(1024 MiB\)"):
            wait_gpu_release({proc.pid}, timeout_s=0.6)
    finally:
        kill(proc)


@pytest.mark.skipif(not gpus.has_cuda_gpus(), reason="needs a CUDA GPU and nvidia-smi")
def test_release_of_real_gpu_memory_after_sigkill() -> None:
    """On a GPU host: nvidia-smi must list the holder by the pid we know (else the check passes vacuously),
    the wait must fail while it lives, and must end once it is killed."""
    proc = start_holder(HOLDER)
    try:
        apps = gpus.gpu_compute_apps() or {}
        assert apps.get(proc.pid, 0) >= 1024, f"nvidia-smi does not show pid {proc.pid} holding memory: {apps}"
        with pytest.raises(ServerError, match=rf"pid {proc.pid} "):
            wait_gpu_release({proc.pid}, timeout_s=1)
    finally:
        pids = kill(proc)
    start = time.monotonic()
    wait_gpu_release(pids, timeout_s=30)
    print(f"released {time.monotonic() - start:.2f} s after SIGKILL")
    assert proc.pid not in (gpus.gpu_compute_apps() or {})


def test_preflight_counts_the_gpu_that_device_auto_trains_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the H200 training's preflight said `gpus 0` with `training.device: auto`, then trained on cuda:0:
    no check that the GPU was there. auto counts one GPU on a CUDA host, none elsewhere."""
    from eagle3_core import preflight

    monkeypatch.setattr(preflight, "has_cuda_gpus", lambda: True)
    assert [preflight.device_gpus(d) for d in ("auto", "cuda", "cuda:1", "cpu")] == [1, 1, 1, 0]
    monkeypatch.setattr(preflight, "has_cuda_gpus", lambda: False)
    assert preflight.device_gpus("auto") == 0
