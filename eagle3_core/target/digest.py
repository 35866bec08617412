"""The target's identity by content: the sha256 of each of its weight files, recorded in its manifest's files
(so its digest changes when a local folder's weights are overwritten in place with others of the same shape),
computed once and kept by (path, size, mtime_ns, inode).

A Hub snapshot's files are links to blobs named by their content's sha256 (huggingface_hub's cache), so its
digest costs nothing; a local folder's files are hashed once (the first `prepare_target` of a 547 GB folder
reads it whole, once), the digests kept in `<target.cache_dir>/weight-digests.json` for every later run.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from eagle3_core.files import sha256_file, write_text_atomic

BLOB = re.compile(r"[0-9a-f]{64}")
DIGESTS_FILE = "weight-digests.json"


def stat_key(path: Path) -> str:
    """What says a file is the one hashed before: its path, size, modification time and inode."""
    stat = path.stat()
    return f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{stat.st_ino}"


def blob_digest(path: Path) -> str | None:
    """The sha256 a Hub cache's blob is named by, for a snapshot's link to one; else None."""
    if not path.is_symlink():
        return None
    name = path.resolve().name
    return name if BLOB.fullmatch(name) else None


def file_digest(path: Path, known: dict[str, str], compute: bool) -> str | None:
    """`path`'s sha256: its blob's name, the one kept in `known` for the same stat, else hashed and kept
    (`compute`) or None."""
    from_blob = blob_digest(path)
    if from_blob is not None:
        return from_blob
    key = stat_key(path)
    if key not in known and compute:
        known[key] = sha256_file(path)
    return known.get(key)


def weight_digests(folder: Path, cache_dir: Path, compute: bool = True) -> dict[str, str] | None:
    """Safetensors file name -> its content's sha256, for every one in `folder`; without `compute` (a plan:
    nothing read whole, nothing written), None where a file was never hashed."""
    store = Path(cache_dir).expanduser() / DIGESTS_FILE
    known: dict[str, str] = json.loads(store.read_text()) if store.is_file() else {}
    before = dict(known)
    digests = {p.name: file_digest(p, known, compute) for p in sorted(folder.glob("*.safetensors"))}
    if known != before:
        store.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(store, json.dumps(known, indent=1, sort_keys=True))
    if None in digests.values():
        return None
    return {name: digest for name, digest in digests.items() if digest is not None}
