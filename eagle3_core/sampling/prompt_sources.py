"""Where prompt rows come from: a JSONL file, a JSON array, a Parquet file, a `datasets` folder written by
`save_to_disk` (Arrow files, read with pyarrow: `datasets` itself is not needed), a folder of such data files,
or a Hub dataset id `org/name[@revision]`, whose data files (Parquet, JSONL, JSON, Arrow) huggingface_hub
fetches into its cache (with `HF_HUB_OFFLINE=1`, the cached snapshot only).

Each reader yields (location, record): the location names the file and the line or row, for errors.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from eagle3_core.files import sha256_file, sha256_json

FILE_TYPES = (".jsonl", ".json", ".parquet", ".arrow")
METADATA_FILES = {"dataset_info.json", "dataset_infos.json", "state.json", "dataset_dict.json"}
DEFAULT_SPLIT = "train"

Record = tuple[str, Any]


class PromptFileError(ValueError):
    """A prompt source that cannot be read; the message names the file and the line or row."""


def read_jsonl(path: Path) -> Iterator[Record]:
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            where = f"{path}:{number}"
            try:
                line = raw.decode("utf-8")
                if not line.strip():
                    continue
                yield where, json.loads(line)
            except UnicodeDecodeError as exc:
                raise PromptFileError(f"{where}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
            except (ValueError, RecursionError) as exc:
                raise PromptFileError(f"{where}: not a JSON object: {exc}") from None


def starts_with_bracket(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4096).lstrip()[:1] == b"["


def read_json(path: Path) -> Iterator[Record]:
    """A `.json` file: one JSON array of rows, or JSON lines."""
    if not starts_with_bracket(path):
        yield from read_jsonl(path)
        return
    try:
        rows = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as exc:
        raise PromptFileError(f"{path}: not a JSON array: {exc}") from None
    for number, row in enumerate(rows, start=1):
        yield f"{path}: row {number}", row


def table_rows(path: Path, table: Any) -> Iterator[Record]:
    for number, row in enumerate(table.to_pylist(), start=1):
        yield f"{path}: row {number}", row


def read_parquet(path: Path) -> Iterator[Record]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises several unrelated types for a damaged file
        raise PromptFileError(f"{path}: not a readable Parquet file: {exc}") from None
    yield from table_rows(path, table)


def read_arrow(path: Path) -> Iterator[Record]:
    """An Arrow file as `datasets` writes them (the IPC stream format), or the IPC file format."""
    import pyarrow as pa

    try:
        with pa.memory_map(str(path)) as source:
            try:
                table = pa.ipc.open_stream(source).read_all()
            except pa.ArrowInvalid:
                source.seek(0)
                table = pa.ipc.open_file(source).read_all()
    except Exception as exc:  # pyarrow raises several unrelated types for a damaged file
        raise PromptFileError(f"{path}: not a readable Arrow file: {exc}") from None
    yield from table_rows(path, table)


def read_data_file(path: Path) -> Iterator[Record]:
    readers = {".jsonl": read_jsonl, ".json": read_json, ".parquet": read_parquet, ".arrow": read_arrow}
    if path.suffix not in readers:
        raise PromptFileError(f"{path}: unknown prompt file type (use {', '.join(FILE_TYPES)} or a folder)")
    return readers[path.suffix](path)


def saved_dataset_files(folder: Path) -> list[Path] | None:
    """The Arrow files of a `save_to_disk` folder, in order; a DatasetDict's `train` split (or its only
    split); None for a folder `datasets` did not write."""
    if (folder / "dataset_dict.json").is_file():
        splits = json.loads((folder / "dataset_dict.json").read_text())["splits"]
        if DEFAULT_SPLIT not in splits and len(splits) != 1:
            raise PromptFileError(f"{folder}: splits {splits} and none is `train`: name the split's folder")
        return saved_dataset_files(folder / (DEFAULT_SPLIT if DEFAULT_SPLIT in splits else splits[0]))
    if (folder / "state.json").is_file():
        state = json.loads((folder / "state.json").read_text())
        return [folder / entry["filename"] for entry in state["_data_files"]]
    return None


def in_split(path: Path, root: Path, split: str) -> bool:
    """`data/train-00000-of-00001.parquet`, `train/0.jsonl`, `train.jsonl`: the split is a folder or the
    start of the file's name."""
    parts = path.relative_to(root).parts
    return split in parts[:-1] or parts[-1].startswith(split)


def folder_files(folder: Path) -> list[Path]:
    """The data files of a folder: a `save_to_disk` folder's Arrow files, else every data file under it
    (the `train` split's where file names say so), in path order."""
    saved = saved_dataset_files(folder)
    if saved is not None:
        return saved
    files = sorted(p for p in folder.rglob("*") if p.suffix in FILE_TYPES and p.name not in METADATA_FILES)
    files = [p for p in files if not any(part.startswith(".") for part in p.relative_to(folder).parts)]
    train = [p for p in files if in_split(p, folder, DEFAULT_SPLIT)]
    if not (train or files):
        raise PromptFileError(f"{folder}: no prompt data files ({', '.join(FILE_TYPES)}) in this folder")
    return train or files


def hub_dataset_folder(source: str) -> Path:
    """The local snapshot of Hub dataset `org/name[@revision]`, its data files only."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError, OfflineModeIsEnabled

    from eagle3_core.target.hub import HubTargetError
    from eagle3_core.target.reference import parse_hub_id

    try:
        hub = parse_hub_id(source, "sampling.prompt_files")
    except HubTargetError as exc:
        raise PromptFileError(str(exc)) from None
    if hub is None:
        raise PromptFileError(f"{source}: prompt file not found")
    patterns = [f"*{suffix}" for suffix in FILE_TYPES]
    try:
        return Path(snapshot_download(hub.repo_id, repo_type="dataset", revision=hub.revision, allow_patterns=patterns))
    except (LocalEntryNotFoundError, OfflineModeIsEnabled):
        raise PromptFileError(
            f"{source}: neither a prompt file nor a Hub dataset in the local cache (HF_HUB_OFFLINE is set, or the "
            "Hub is unreachable)"
        ) from None
    except (HFValidationError, OSError) as exc:
        raise PromptFileError(f"{source}: Hub dataset not readable ({type(exc).__name__})") from None


def source_files(source: str, demo: Path) -> list[Path]:
    """The data files `source` names: `demo`, a file, a folder, or a Hub dataset id (a path that exists wins)."""
    if source == "demo":
        return [demo]
    path = Path(source).expanduser()
    if path.is_file():
        return [path]
    if path.is_dir():
        return folder_files(path)
    if path.suffix in FILE_TYPES or source.startswith((".", "/", "~")):
        raise PromptFileError(f"{path}: prompt file not found")
    return folder_files(hub_dataset_folder(source))


def read_source(source: str, demo: Path) -> Iterator[Record]:
    """(location, record) of every row of `source`, file after file."""
    for path in source_files(source, demo):
        yield from read_data_file(path)


def source_digest(source: str, demo: Path) -> str:
    """The content of `source`'s data files, for cache keys (`missing` when it names nothing readable)."""
    try:
        files = source_files(source, demo)
    except PromptFileError:
        return "missing"
    return sha256_json([sha256_file(p) for p in files]) if len(files) > 1 else sha256_file(files[0])
