"""Repack a wheel for transfer: members stored uncompressed (the payload's zstd then compresses across them,
vLLM's FlashAttention-3 build 145 MB -> 15 MB against deflate's 36 MB) and, for vLLM 0.26.0, without what a
dense target does not need on the H200 (DEVICE_NOTES: the FlashAttention-2 build, the Rust front end, two
vendored kernel trees; FA3's build must stay, vLLM's worker imports it at warm-up), and for sglang-kernel
what SGLang's triton attention backend does not load on an H200 (615 MB -> about 25 MB compressed). `_moe_C` (39 MB) is
needed for MoE targets only, so it is dropped unless asked for."""

from __future__ import annotations

import zipfile
from pathlib import Path

TRIMMED_PREFIXES = (
    "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",
    "vllm/vllm-rs",
    "vllm/third_party/deep_gemm/",
    "vllm/third_party/fmha_sm100/",
    # sglang-kernel 0.4.4: SGLang's FlashAttention build (1.76 GB, imported only by its fa3 attention backend;
    # the H200 run uses the triton backend) and the Blackwell build of its common ops.
    "sgl_kernel/flash_ops.abi3.so",
    "sgl_kernel/sm100/",
)
MOE_KERNELS = "vllm/_moe_C_stable_libtorch.abi3.so"


def is_trimmed(member: str, keep_moe: bool) -> bool:
    """Whether a wheel member is left out of the repacked wheel."""
    return member.startswith(TRIMMED_PREFIXES) or (member == MOE_KERNELS and not keep_moe)


def record_without(record: str, members: set[str]) -> str:
    """The wheel's RECORD without the lines of removed members (pip would otherwise list files it lacks)."""
    kept = [line for line in record.splitlines() if line.split(",", 1)[0] not in members]
    return "\n".join(kept) + "\n"


def repack_wheel(wheel: Path, out_dir: Path, keep_moe: bool = False) -> Path:
    """`out_dir/<same name>`: every member stored, trimmed members left out, RECORD mended."""
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / wheel.name
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as target:
        removed = {info.filename for info in source.infolist() if is_trimmed(info.filename, keep_moe)}
        for info in source.infolist():
            if info.filename in removed:
                continue
            data = source.read(info)
            if info.filename.endswith(".dist-info/RECORD") and removed:
                data = record_without(data.decode(), removed).encode()
            info.compress_type = zipfile.ZIP_STORED
            target.writestr(info, data)
    return out
