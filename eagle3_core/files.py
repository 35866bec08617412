"""Atomic writes and content digests: a reader never sees half a file, and every file's sha256 is
computed once, while it is written, and recorded in its manifest."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

CHUNK = 1 << 22
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
DISK_FULL_TEXT = ("No space left on device", "Disk quota exceeded", "os error 28", "os error 122")


class DiskFullError(OSError):
    """A write that ran out of disk space or quota. The message names the file, the bytes the write needed
    and the bytes free; nothing of the write is left behind. Retrying does not help until space is freed."""

    def __init__(self, path: Path, needed: int, free: int):
        self.path, self.needed, self.free = Path(path), needed, free
        super().__init__(
            errno.ENOSPC,
            f"disk full writing {path}: the write needs about {needed:,} bytes, {free:,} bytes are free on "
            f"its file system; free space (or set run_dir elsewhere) and run again: finished work is kept",
        )

    def __str__(self) -> str:
        return self.strerror

    def __reduce__(self):
        return DiskFullError, (self.path, self.needed, self.free)


class UnreadableFile(ValueError):
    """A file given to the pipeline (a draft's or a target's config.json) that is not what it should be:
    the message names the file, what is wrong with it and what to do."""


def read_json_object(path: Path, remedy: str) -> dict[str, Any]:
    """The JSON object in `path`, or UnreadableFile naming the file, the defect and `remedy` (what to do)."""
    try:
        data = json.loads(Path(path).read_text())
    except UnicodeDecodeError as exc:
        raise UnreadableFile(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start}); {remedy}") from None
    except json.JSONDecodeError as exc:
        where = f"{exc.msg} at line {exc.lineno} column {exc.colno}"
        raise UnreadableFile(f"{path}: not valid JSON ({where}); {remedy}") from None
    if not isinstance(data, dict):
        raise UnreadableFile(f"{path}: holds a JSON {type(data).__name__}, not an object; {remedy}")
    return data


def free_bytes(path: Path) -> int:
    """Bytes free to this user on the file system of `path` (or of its nearest existing ancestor)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def folder_bytes(folder: Path) -> int:
    """Bytes of the files under `folder` (0 where it does not exist)."""
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def folder_identity(root: Path | str | None) -> list[tuple[str, int, int]] | None:
    """(relative path, size, mtime_ns) of every file under `root` (None: None): what keys an input folder
    too large to hash on every run (a target, a warm-start checkpoint), so that a new revision in the same
    folder is new input."""
    if root is None:
        return None
    folder = Path(root).expanduser()
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    return [(str(p.relative_to(folder)), (st := p.stat()).st_size, st.st_mtime_ns) for p in files]


def sha256_json(value: Any) -> str:
    """Digest of a JSON-able value, independent of key order."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


def is_disk_full(exc: BaseException) -> bool:
    """True for ENOSPC/EDQUOT, also where a library reports it only in its message (safetensors does)."""
    return (isinstance(exc, OSError) and exc.errno in DISK_FULL_ERRNOS) or any(t in str(exc) for t in DISK_FULL_TEXT)


@contextmanager
def atomic_path(path: Path, needed: int | None = None) -> Iterator[Path]:
    """Yield a temporary path beside `path`; rename it over `path` only when the block succeeds.

    On any error the temporary file is removed and `path` is left as it was. A full disk or quota is
    raised as `DiskFullError` naming `path`, the bytes needed and the bytes free: recognised by its errno
    or message, or, for writers that hide it (torch.save), by `needed` (the write's size, where the caller
    knows it) exceeding the space free once the temporary file is gone.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except Exception as exc:
        written = tmp.stat().st_size if tmp.exists() else 0
        tmp.unlink(missing_ok=True)
        links = [link for link in (exc, exc.__cause__, exc.__context__) if link is not None]
        for link in links:
            # The writer's frames may hold the deleted temporary file open (pyarrow does), and with it the
            # space, for as long as this exception lives: release them now.
            traceback.clear_frames(link.__traceback__)
        free = free_bytes(path.parent)
        if any(is_disk_full(link) for link in links) or (needed is not None and needed > free):
            raise DiskFullError(path, max(needed or 0, written), free) from exc
        raise
    finally:
        tmp.unlink(missing_ok=True)


def writer_alive(pid: int) -> bool:
    """Whether process `pid` still runs on this host (a process of another user counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_dead_temps(folder: Path) -> list[Path]:
    """Remove the temporary files `atomic_path` left in `folder` when its writer was killed (`.<name>.tmp-<pid>`
    of a pid that no longer runs); a live writer's are left alone. Returns those removed."""
    removed = []
    for tmp in Path(folder).glob(".*.tmp-*"):
        pid = tmp.name.rpartition(".tmp-")[2]
        if pid.isdigit() and int(pid) != os.getpid() and not writer_alive(int(pid)) and tmp.is_file():
            tmp.unlink(missing_ok=True)
            removed.append(tmp)
    return removed


def write_bytes_atomic(path: Path, data: bytes) -> None:
    with atomic_path(path, needed=len(data)) as tmp:
        tmp.write_bytes(data)


def write_text_atomic(path: Path, text: str) -> None:
    write_bytes_atomic(path, text.encode())
