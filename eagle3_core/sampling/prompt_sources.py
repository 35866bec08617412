"""Where prompt rows come from: a JSONL file, a JSON array, a Parquet or Arrow file, a folder of such data
files (read here, file by file), and what `datasets` reads as its users do: a folder written by
`Dataset.save_to_disk` / `DatasetDict.save_to_disk` (`datasets.load_from_disk`), or a Hub dataset id
`org/name[@revision]` (`datasets.load_dataset_builder`, then as `load_dataset` does: its `train` split, else
every split). Offline (`HF_HUB_OFFLINE=1`), `datasets` reads a Hub dataset from its own cache (the latest
version it prepared); where that holds none, or another revision than the one pinned, it reads the snapshot in
huggingface_hub's cache (`hf download --repo-type dataset`). `datasets` is imported only to read such a source.

Each reader yields (location, record): the location names the file (or the folder or Hub id and the split)
and the line or row, for errors.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagle3_core.files import sha256_file, sha256_json

if TYPE_CHECKING:
    from datasets import Dataset, DatasetBuilder

    from eagle3_core.target.hub import HubId

FILE_TYPES = (".jsonl", ".json", ".parquet", ".arrow")
METADATA_FILES = {"dataset_info.json", "dataset_infos.json", "state.json", "dataset_dict.json"}
DEFAULT_SPLIT = "train"

Record = tuple[str, Any]


class PromptFileError(ValueError):
    """A prompt source that cannot be read; the message names the file and the line or row."""


@dataclass(frozen=True)
class DatasetSource:
    """A source `datasets` reads: the splits read, each as (the name its rows go by, the Dataset), and the
    digest of their content, computed when asked (a folder's is its Arrow files', read whole)."""

    splits: list[tuple[str, Dataset]]
    digest: Callable[[], str]


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


def first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def files_digest(files: list[Path]) -> str:
    return sha256_json([sha256_file(p) for p in files]) if len(files) > 1 else sha256_file(files[0])


def is_saved_dataset(folder: Path) -> bool:
    """Whether `save_to_disk` wrote `folder`: a Dataset's `state.json` or a DatasetDict's `dataset_dict.json`."""
    return (folder / "state.json").is_file() or (folder / "dataset_dict.json").is_file()


def saved_split(splits: list[str], folder: Path) -> str:
    """The split a DatasetDict folder is read for: `train`, or its only split."""
    if DEFAULT_SPLIT in splits:
        return DEFAULT_SPLIT
    if len(splits) == 1:
        return splits[0]
    raise PromptFileError(f"{folder}: splits {splits} and none is `train`: name the split's folder")


def saved_dataset(folder: Path) -> DatasetSource:
    """A `save_to_disk` folder as `datasets.load_from_disk` reads it (a DatasetDict: the split `saved_split`
    picks); its digest is that of the Arrow files read."""
    import datasets

    try:
        loaded = datasets.load_from_disk(str(folder), keep_in_memory=False)
    except Exception as exc:  # a damaged folder raises whatever pyarrow, json or fsspec raise
        raise PromptFileError(f"{folder}: not a readable `datasets` folder: {first_line(exc)}") from None
    where = str(folder)
    if isinstance(loaded, datasets.DatasetDict):
        split = saved_split(list(loaded), folder)
        loaded, where = loaded[split], f"{folder}[{split}]"
    files = [Path(entry["filename"]) for entry in loaded.cache_files]
    return DatasetSource([(where, loaded)], partial(files_digest, files))


def hub_snapshot(hub: HubId, source: str) -> Path:
    """The snapshot of Hub dataset `hub` in huggingface_hub's cache, never fetched (`datasets` found the Hub
    unreachable); where there is none, the one-line error names both caches."""
    from datasets import config
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(hub.repo_id, repo_type="dataset", revision=hub.revision, local_files_only=True))
    except LocalEntryNotFoundError:
        raise PromptFileError(
            f"{source}: neither a prompt file nor a Hub dataset in the local caches (`datasets`' "
            f"{config.HF_DATASETS_CACHE}, huggingface_hub's {constants.HF_HUB_CACHE}), and the Hub is unreachable "
            "(HF_HUB_OFFLINE is set, or no network)"
        ) from None


def snapshot_builder(hub: HubId, source: str) -> tuple[DatasetBuilder, str]:
    """The `datasets` builder of the snapshot of `hub` in huggingface_hub's cache, and its commit."""
    import datasets

    snapshot = hub_snapshot(hub, source)
    return datasets.load_dataset_builder(str(snapshot)), snapshot.name


def hub_builder(hub: HubId, source: str) -> tuple[DatasetBuilder, str]:
    """The `datasets` builder of Hub dataset `hub` and the commit it reads. Offline, `datasets` answers from
    its own cache with the latest version it prepared: a dataset it never prepared, or a pinned revision other
    than that one, is read from huggingface_hub's snapshot instead."""
    import datasets
    from datasets.packaged_modules.cache.cache import Cache

    try:
        builder = datasets.load_dataset_builder(hub.repo_id, revision=hub.revision)
    except ConnectionError:  # offline or unreachable, and not in `datasets`' own cache
        return snapshot_builder(hub, source)
    if isinstance(builder, Cache) and hub.revision not in ("main", builder.hash):
        return snapshot_builder(hub, source)
    return builder, str(builder.hash)


def hub_id(source: str) -> HubId:
    """`source` as Hub dataset id `org/name[@revision]`; anything else is a prompt file not found."""
    from eagle3_core.target.hub import HubTargetError
    from eagle3_core.target.reference import parse_hub_id

    try:
        hub = parse_hub_id(source, "sampling.prompt_files")
    except HubTargetError as exc:
        raise PromptFileError(str(exc)) from None
    if hub is None:
        raise PromptFileError(f"{source}: prompt file not found")
    return hub


def hub_dataset(hub: HubId, source: str) -> DatasetSource:
    """Hub dataset `hub` as `load_dataset` reads it: its `train` split, else every split; the digest is the
    commit read and the splits."""
    from datasets.exceptions import DatasetsError

    try:
        builder, commit = hub_builder(hub, source)
        builder.download_and_prepare()
        names = list(builder.info.splits)
        names = [DEFAULT_SPLIT] if DEFAULT_SPLIT in names else names
        splits = [(f"{source}[{name}]", builder.as_dataset(split=name)) for name in names]
    except PromptFileError:
        raise
    except (DatasetsError, OSError, ValueError, RuntimeError) as exc:
        raise PromptFileError(f"{source}: Hub dataset not readable by `datasets`: {first_line(exc)}") from None
    return DatasetSource(splits, partial(sha256_json, [hub.repo_id, commit, names]))


def dataset_rows(source: DatasetSource) -> Iterator[Record]:
    """Every row of every split, as plain Python values (whatever format the dataset was saved with)."""
    for where, dataset in source.splits:
        for number, row in enumerate(dataset.with_format(None), start=1):
            yield f"{where}: row {number}", row


def in_split(path: Path, root: Path, split: str) -> bool:
    """`data/train-00000-of-00001.parquet`, `train/0.jsonl`, `train.jsonl`: the split is a folder or the
    start of the file's name."""
    parts = path.relative_to(root).parts
    return split in parts[:-1] or parts[-1].startswith(split)


def data_folder_files(folder: Path) -> list[Path]:
    """Every data file under a folder `datasets` did not write (the `train` split's where file names say
    so), in path order."""
    files = sorted(p for p in folder.rglob("*") if p.suffix in FILE_TYPES and p.name not in METADATA_FILES)
    files = [p for p in files if not any(part.startswith(".") for part in p.relative_to(folder).parts)]
    train = [p for p in files if in_split(p, folder, DEFAULT_SPLIT)]
    if not (train or files):
        raise PromptFileError(f"{folder}: no prompt data files ({', '.join(FILE_TYPES)}) in this folder")
    return train or files


def open_source(source: str, demo: Path) -> list[Path] | DatasetSource:
    """What `source` names: `demo`, a file or a plain folder (their data files, read here), or a `save_to_disk`
    folder or a Hub dataset id (read through `datasets`); a path that exists wins over a Hub id."""
    if source == "demo":
        return [demo]
    path = Path(source).expanduser()
    if path.is_file():
        return [path]
    if path.is_dir():
        return saved_dataset(path) if is_saved_dataset(path) else data_folder_files(path)
    if path.suffix in FILE_TYPES or source.startswith((".", "/", "~")):
        raise PromptFileError(f"{path}: prompt file not found")
    return hub_dataset(hub_id(source), source)


def read_source(source: str, demo: Path) -> Iterator[Record]:
    """(location, record) of every row of `source`, file after file (split after split)."""
    opened = open_source(source, demo)
    if isinstance(opened, DatasetSource):
        yield from dataset_rows(opened)
        return
    for path in opened:
        yield from read_data_file(path)


def source_digest(source: str, demo: Path) -> str:
    """The content of `source`, for cache keys (`missing` when it names nothing readable): its data files'
    bytes; a Hub dataset's commit."""
    try:
        opened = open_source(source, demo)
    except PromptFileError:
        return "missing"
    return opened.digest() if isinstance(opened, DatasetSource) else files_digest(opened)
