"""Split one payload into parts that each fit one device call, and join them again, checking sha256.

A call carries at most 64 MiB with the working tree, so the payload (a zstd-compressed tar of the wheels) is
cut into parts of at most `PART_BYTES`, one per call folder `.gpu-stage/call-NN/` with a copy of the
manifest. Standard library only: the device side imports this module with the device's own Python."""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from eagle3_core.files import sha256_file

PART_BYTES = 55 * 2**20
MANIFEST = "manifest.json"
CHUNK = 8 * 2**20


@dataclass(frozen=True)
class Part:
    name: str
    sha256: str
    size: int


@dataclass(frozen=True)
class Manifest:
    """The payload (its name, sha256, size), its parts in order, and every wheel it holds -> sha256."""

    payload: str
    sha256: str
    size: int
    parts: tuple[Part, ...]
    wheels: dict[str, str]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        data = json.loads(text)
        data["parts"] = tuple(Part(**part) for part in data["parts"])
        return cls(**data)


def part_ranges(size: int, part_bytes: int = PART_BYTES) -> list[tuple[int, int]]:
    """(offset, length) of each part of a file of `size` bytes; at least one part, even for an empty file."""
    if part_bytes <= 0:
        raise ValueError(f"part size must be positive, got {part_bytes}")
    return [(offset, min(part_bytes, size - offset)) for offset in range(0, max(size, 1), part_bytes)]


def split_file(payload: Path, out_root: Path, wheels: dict[str, str], part_bytes: int = PART_BYTES) -> Manifest:
    """Cut `payload` into `out_root/call-NN/part-NN`, one part per call folder, each with the manifest."""
    size = payload.stat().st_size
    parts = []
    with open(payload, "rb") as stream:
        for index, (offset, length) in enumerate(part_ranges(size, part_bytes)):
            folder = out_root / f"call-{index:02d}"
            folder.mkdir(parents=True, exist_ok=True)
            target = folder / f"part-{index:02d}"
            stream.seek(offset)
            target.write_bytes(stream.read(length))
            parts.append(Part(target.name, sha256_file(target), length))
    manifest = Manifest(payload.name, sha256_file(payload), size, tuple(parts), wheels)
    for index in range(len(parts)):
        (out_root / f"call-{index:02d}" / MANIFEST).write_text(manifest.to_json())
    return manifest


def stash_parts(call_folders: list[Path], stash: Path) -> list[str]:
    """Copy the parts these call folders carry into `stash` (checked against their manifest); returns the names
    copied. A part already in the stash with the right digest is not copied again."""
    stash.mkdir(parents=True, exist_ok=True)
    copied = []
    for folder in call_folders:
        manifest = Manifest.from_json((folder / MANIFEST).read_text())
        shutil.copyfile(folder / MANIFEST, stash / MANIFEST)
        for part in manifest.parts:
            source = folder / part.name
            if not source.is_file() or part_ok(stash / part.name, part):
                continue
            if sha256_file(source) != part.sha256:
                raise ValueError(f"{source}: sha256 differs from the manifest (damaged in transfer)")
            shutil.copyfile(source, stash / part.name)
            copied.append(part.name)
    return copied


def part_ok(path: Path, part: Part) -> bool:
    return path.is_file() and path.stat().st_size == part.size and sha256_file(path) == part.sha256


def missing_parts(manifest: Manifest, stash: Path) -> list[str]:
    """The parts not (or not intact) in the stash: non-empty when the machine was given back in between."""
    return [part.name for part in manifest.parts if not part_ok(stash / part.name, part)]


def join_parts(manifest: Manifest, stash: Path, out: Path) -> Path:
    """Concatenate the stashed parts into `out` and check the payload's sha256 against the manifest."""
    missing = missing_parts(manifest, stash)
    if missing:
        raise FileNotFoundError(f"stash {stash} lacks {missing}: the machine was given back, stage again")
    with open(out, "wb") as joined:
        for part in manifest.parts:
            with open(stash / part.name, "rb") as source:
                shutil.copyfileobj(source, joined, CHUNK)
    if (digest := sha256_file(out)) != manifest.sha256:
        raise ValueError(f"{out}: sha256 {digest} != manifest {manifest.sha256}")
    return out
