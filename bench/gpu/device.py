"""The device side of the staging (run there with the device's own python3, from the repository root):

    python3 -m bench.gpu.device stash      # copy the parts this call carries into the temp-dir stash
    python3 -m bench.gpu.device install    # stash, then join, check sha256, unpack, pip install --no-deps
    export PYTHONPATH=$(python3 -m bench.gpu.device site):$PWD
    python3 -m bench.gpu.device install --engine sglang   # SGLang's payload into a site of its own

The stash lives in `tempfile.gettempdir()`, which survives between calls while the machine stays warm (about
30 s idle); a call that finds parts missing says so: the machine was given back, stage again. Needs only the
standard library and pyarrow (for zstd), both on the device image.
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

from bench.gpu.parts import CHUNK, MANIFEST, Manifest, join_parts, missing_parts, sha256_file, stash_parts

CALL_FOLDERS = ".gpu-stage"
DONE = ".eagle3-staged"


def stage_root(engine: str = "vllm") -> Path:
    """The engine's stash and site live here; vLLM's at the top, other engines' below."""
    root = Path(tempfile.gettempdir()) / "eagle3-gpu"
    return root if engine == "vllm" else root / engine


def site_dir(engine: str = "vllm") -> Path:
    return stage_root(engine) / "site"


def call_folders(engine: str) -> list[Path]:
    """The call folders this call carries for the engine (`stage.stage_folder`'s layout)."""
    base = Path(CALL_FOLDERS) if engine == "vllm" else Path(CALL_FOLDERS) / engine
    return sorted(base.glob("call-*"))


def zstd_decompress(source: Path, out: Path) -> Path:
    import pyarrow as pa

    with pa.input_stream(str(source), compression="zstd") as stream, open(out, "wb") as target:
        while block := stream.read(CHUNK):
            target.write(block)
    return out


def unpack_wheels(payload: Path, out_dir: Path, wheels: dict[str, str]) -> list[Path]:
    """The tar's wheels, each checked against the manifest's sha256; anything else in the tar is refused."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with tarfile.open(payload) as tar:
        names = tar.getnames()
        unexpected = sorted(set(names) - set(wheels))
        if unexpected or "/" in "".join(names):
            raise ValueError(f"{payload}: members not in the manifest: {unexpected or names}")
        tar.extractall(out_dir, filter="data")
    paths = [out_dir / name for name in sorted(wheels)]
    bad = [path.name for path in paths if sha256_file(path) != wheels[path.name]]
    if bad:
        raise ValueError(f"sha256 differs from the manifest for {bad}")
    return paths


def pip_install_command(wheels: list[Path], target: Path) -> list[str]:
    return [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-cache-dir",
            "--upgrade", "--target", str(target), *map(str, wheels)]  # fmt: skip


def installed_conflicts(site: Path) -> list[str]:
    """Version conflicts of the carried distributions with what the device's python then imports."""
    from bench.gpu.packages import version_conflicts

    search = [str(site), *sys.path]

    def version_of(name: str) -> str | None:
        for dist in metadata.distributions(name=name, path=search):
            return dist.version
        return None

    carried: Iterable[metadata.Distribution] = metadata.distributions(path=[str(site)])
    return version_conflicts({d.metadata["Name"]: d.requires or [] for d in carried}, version_of)


def stash(root: Path, engine: str = "vllm") -> Manifest | None:
    copied = stash_parts(call_folders(engine), root / "parts")
    manifest_path = root / "parts" / MANIFEST
    if not manifest_path.is_file():
        print("stash: no parts carried and none stashed")
        return None
    manifest = Manifest.from_json(manifest_path.read_text())
    missing = missing_parts(manifest, root / "parts")
    print(f"stash {root / 'parts'}: copied {copied}; {len(manifest.parts) - len(missing)}/{len(manifest.parts)} parts")
    return manifest


def install(root: Path, engine: str = "vllm") -> None:
    start = time.perf_counter()
    manifest = stash(root, engine)
    site = site_dir(engine)
    if manifest is None:
        raise SystemExit("install: nothing staged")
    if (site / DONE).is_file() and (site / DONE).read_text() == manifest.sha256:
        print(f"install: {site} already holds payload {manifest.sha256[:12]}")
        return
    joined = join_parts(manifest, root / "parts", root / manifest.payload)
    tar_path = zstd_decompress(joined, root / "wheels.tar")
    joined.unlink()
    wheels = unpack_wheels(tar_path, root / "wheels", manifest.wheels)
    tar_path.unlink()
    unpacked = time.perf_counter()
    shutil.rmtree(site, ignore_errors=True)
    subprocess.run(pip_install_command(wheels, site), check=True)
    (site / DONE).write_text(manifest.sha256)
    shutil.rmtree(root / "wheels")
    conflicts = installed_conflicts(site)
    print(f"install: {len(wheels)} wheels into {site}: joined+checked+unpacked {unpacked - start:.1f} s, "
          f"pip {time.perf_counter() - unpacked:.1f} s; version conflicts: {conflicts or 'none'}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description="device side of the GPU staging")
    parser.add_argument("step", choices=["stash", "install", "site"])
    parser.add_argument("--engine", choices=["vllm", "sglang"], default="vllm", help="which payload")
    args = parser.parse_args()
    if args.step == "site":
        print(site_dir(args.engine))
    elif args.step == "stash":
        stash(stage_root(args.engine), args.engine)
    else:
        install(stage_root(args.engine), args.engine)


if __name__ == "__main__":
    main()
