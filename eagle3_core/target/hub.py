"""Targets named by a Hugging Face Hub id, `org/name` or `org/name@revision` (a branch, a tag or a commit sha).

`target.model` is read in this order: an embedded target's name; an existing folder (a local target: it wins
over a Hub id spelt the same); else `org/name[@revision]` is a Hub id. A Hub id is resolved by huggingface_hub
into the Hub's own cache (`HF_HOME` / `HF_HUB_CACHE`), only the files serving needs: a file already in the cache
is never fetched again (a stopped download goes on file by file), and a connection cut mid-file resumes at the
byte it stopped (HTTP Range). The snapshot folder `<cache>/models--org--name/snapshots/<sha>` is the
target's folder: vLLM and transformers load it in place, with no second download.

huggingface_hub honours `HF_HUB_OFFLINE` (the cached snapshot of the revision, no request), `HF_ENDPOINT` and
`HF_TOKEN`; the token is only ever sent by it, never read into a message here.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3_core.phases import PREPARE_TARGET
from eagle3_core.progress import ProgressCallback, ProgressUpdate, RateMeter

# What vLLM and transformers read to serve a model: weights, configs, tokenizer and chat template files.
SERVING_FILES = [
    "*.safetensors",
    "model.safetensors.index.json",
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "*.tiktoken",
    "chat_template.jinja",
    "chat_template.json",
]
HUB_ID = re.compile(r"(?P<repo_id>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w./-]+))?")
COMMIT = re.compile(r"[0-9a-f]{40}")
BYTES_BAR = "huggingface_hub.snapshot_download"  # the bar of bytes written, whose total is the files' sizes
PHASE = PREPARE_TARGET.name


class HubTargetError(ValueError):
    """A Hub id that cannot be resolved as asked (unknown, gated, no such revision, not cached while offline):
    bad input a retry would repeat. The message says what to do; it never holds the token."""


@dataclass(frozen=True)
class HubId:
    """A Hub repository and the revision asked for (`main` unless `@revision` names one)."""

    repo_id: str
    revision: str = "main"

    def __str__(self) -> str:
        return f"{self.repo_id}@{self.revision}"

    @property
    def pinned(self) -> bool:
        """The revision is a commit sha: it never moves."""
        return bool(COMMIT.fullmatch(self.revision))


def parse_hub_id(model: str) -> HubId | None:
    """`org/name` or `org/name@revision` as a HubId; None for anything else. Callers test for an existing
    folder first: a folder wins over a Hub id of the same spelling."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    match = HUB_ID.fullmatch(model)
    if match is None:
        return None
    try:
        validate_repo_id(match["repo_id"])
    except HFValidationError as exc:
        raise HubTargetError(f"target.model {model!r}: not a Hub id huggingface_hub accepts ({exc})") from None
    return HubId(match["repo_id"], match["revision"] or "main")


def hub_id_of(model: str) -> HubId | None:
    """The Hub id `target.model` names; None for an existing folder (it wins) or anything else not of the form
    `org/name[@revision]` (an embedded name has no `/`)."""
    return None if Path(model).expanduser().is_dir() else parse_hub_id(model)


def hub_error(hub: HubId, exc: BaseException) -> HubTargetError | None:
    """The one-line user error of a huggingface_hub failure, or None for one that is not the user's to fix
    (a Hub outage, a lost connection mid-download: transient). Built from the id alone, never from the
    library's message, so no header or token can leak into it."""
    from huggingface_hub import constants, get_token
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        IncompleteSnapshotError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"target.model {hub}"
    page = f"{constants.ENDPOINT}/{hub.repo_id}"
    if isinstance(exc, GatedRepoError):
        if get_token() is None:
            return HubTargetError(
                f"{where}: {hub.repo_id} is gated: accept its terms on {page} and set HF_TOKEN to a token of "
                "that account (or run `hf auth login`)"
            )
        return HubTargetError(f"{where}: {hub.repo_id} is gated and HF_TOKEN's account has no access: accept its "
                              f"terms on {page} with that account")  # fmt: skip
    if isinstance(exc, RepositoryNotFoundError):
        return HubTargetError(
            f"{where}: no repository {hub.repo_id} on {constants.ENDPOINT} (or it is private and HF_TOKEN cannot "
            "read it): check the id (`org/name`, as on its Hub page) or set HF_TOKEN"
        )
    if isinstance(exc, RevisionNotFoundError):
        return HubTargetError(
            f"{where}: {hub.repo_id} has no revision {hub.revision!r}: name a branch, tag or commit sha it has "
            f"(`{hub.repo_id}@main`)"
        )
    if isinstance(exc, IncompleteSnapshotError):
        return HubTargetError(
            f"{where}: the cached snapshot is incomplete and the Hub cannot be reached: run once with network "
            "access (HF_HUB_OFFLINE unset) to finish the download, which resumes where it stopped"
        )
    if isinstance(exc, (LocalEntryNotFoundError, OfflineModeIsEnabled)) and constants.HF_HUB_OFFLINE:
        return HubTargetError(
            f"{where}: HF_HUB_OFFLINE is set and the Hub cache {constants.HF_HUB_CACHE} has no snapshot of it: "
            f"download it once with network access (`eagle3 prepare-target {hub}`), or set HF_HUB_CACHE to the "
            "cache that holds it"
        )
    if isinstance(exc, LocalEntryNotFoundError):
        return HubTargetError(
            f"{where}: {constants.ENDPOINT} cannot be reached and the Hub cache {constants.HF_HUB_CACHE} has no "
            "snapshot of it: check the network (or HF_ENDPOINT), or set HF_HUB_OFFLINE=1 to use a cached revision"
        )
    if isinstance(exc, HfHubHTTPError) and exc.response is not None and exc.response.status_code == 401:
        return HubTargetError(f"{where}: {constants.ENDPOINT} refused HF_TOKEN (401): set a valid token")
    return None


@contextmanager
def hub_errors(hub: HubId) -> Iterator[None]:
    """Turn huggingface_hub's failures the user can fix into one `HubTargetError` line."""
    try:
        yield
    except Exception as exc:
        error = hub_error(hub, exc)
        if error is None:
            raise
        raise error from None


def resolve_commit(hub: HubId) -> str:
    """The commit sha `hub`'s revision names now: itself for a sha; the Hub's answer online (one request, no
    download); offline, the cached ref (`refs/<revision>`). What keys prepare_target's cache."""
    from huggingface_hub import HfApi, constants, snapshot_download

    if hub.pinned:
        return hub.revision
    with hub_errors(hub):
        if constants.HF_HUB_OFFLINE:
            folder = snapshot_download(
                hub.repo_id, revision=hub.revision, allow_patterns=SERVING_FILES, local_files_only=True
            )
            return Path(folder).name
        sha = HfApi().model_info(hub.repo_id, revision=hub.revision).sha
    assert sha is not None, "the Hub answered a model's info without its commit sha"
    return sha


def download_snapshot(hub: HubId, progress: ProgressCallback) -> Path:
    """The snapshot folder of `hub`'s revision, its serving files downloaded where missing (resumed where a
    download stopped), with the bytes written reported to `progress` (MB, MB/s, ETA)."""
    from huggingface_hub import snapshot_download

    with hub_errors(hub):
        folder = Path(
            snapshot_download(
                hub.repo_id,
                revision=hub.revision,
                allow_patterns=SERVING_FILES,
                tqdm_class=reporting_tqdm(progress, str(hub)),
            )
        )
    check_complete(hub, folder)
    return folder


def check_complete(hub: HubId, folder: Path) -> None:
    """A snapshot read from the cache alone may be a download that stopped: its config and every weight file
    its index names must be there."""
    import json

    index = folder / "model.safetensors.index.json"
    shards = set(json.loads(index.read_text())["weight_map"].values()) if index.is_file() else set()
    missing = [name for name in ["config.json", *sorted(shards)] if not (folder / name).is_file()]
    if missing or not any(folder.glob("*.safetensors")):
        raise HubTargetError(
            f"target.model {hub}: the snapshot {folder} lacks {', '.join(missing) or 'its weights'}: run once with "
            "network access (HF_HUB_OFFLINE unset) to finish the download, which resumes where it stopped"
        )


def reporting_tqdm(progress: ProgressCallback, what: str) -> type:
    """A tqdm class for `snapshot_download` that draws nothing itself and reports its bytes bar (the bytes
    written, out of the files' total size, a resumed file's bytes counted at once) to `progress`."""
    from huggingface_hub.utils import tqdm as hf_tqdm

    class DownloadProgress(hf_tqdm):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.reports = kwargs.get("name") == BYTES_BAR
            self.bytes_done = 0.0
            self.meter = RateMeter()
            super().__init__(*args, **{**kwargs, "disable": True})

        def update(self, n: float | None = 1) -> bool | None:
            self.bytes_done += n or 0
            if self.reports and self.total:
                done, total = self.bytes_done / 1e6, self.total / 1e6
                progress(
                    ProgressUpdate(
                        phase=PHASE,
                        stage="download",
                        done=round(done, 1),
                        total=round(total, 1),
                        unit="MB",
                        rate=self.meter.rate(done),
                        rate_unit="MB/s",
                        eta_s=self.meter.eta(done, total),
                        message=what,
                    )
                )
            return super().update(n)

    return DownloadProgress
