"""Publish an export folder (draft, model card, serve scripts) as a Hugging Face Hub model repo, through
`huggingface_hub`'s own client. The token is read from HF_TOKEN and goes only into the client's requests:
never on a command line, into a message or a file."""

from __future__ import annotations

import re
from pathlib import Path

from eagle3_core.release.card import CARD

TOKEN_VARIABLE = "HF_TOKEN"
REPO_ID = re.compile(r"^[\w.-]+/[\w.-]+$")
# What the export folder holds that is not the draft: resumable state and curves live beside it, not in it.
IGNORED = ["*.tmp", ".*"]


class HubError(ValueError):
    """A push that cannot be made as asked (no token, a malformed repo id, an incomplete folder)."""


def check_repo_id(repo_id: str) -> None:
    """An `org/name` the Hub accepts (`huggingface_hub`'s own rules: no `--` or `..`, no leading `-`, ...)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if not REPO_ID.match(repo_id):
        raise HubError(f"--push-to-hub {repo_id!r}: give the repo as org/name")
    try:
        validate_repo_id(repo_id)
    except HFValidationError as exc:
        raise HubError(f"--push-to-hub {repo_id!r}: not a repo id the Hub accepts ({exc})") from None


def check_publishable(folder: Path) -> None:
    """The folder holds a draft and its card."""
    missing = [name for name in ("config.json", "model.safetensors", CARD) if not (folder / name).is_file()]
    if missing:
        raise HubError(f"{folder}: {', '.join(missing)} missing; export the draft (eagle3 train or export) first")


def hub_token() -> str:
    """The token `huggingface_hub` itself would send (HF_TOKEN, else the one `hf auth login` stored), as the
    target's download finds it."""
    from huggingface_hub import get_token

    token = get_token()
    if not token:
        raise HubError(f"no Hub token: export a token with write access as {TOKEN_VARIABLE} (or run `hf auth login`)")
    return token


def push_folder(folder: Path, repo_id: str, private: bool = False, endpoint: str | None = None) -> str:
    """Create the model repo if needed and upload the folder as one commit; returns the commit's URL.
    `endpoint`: another Hub than huggingface.co (else HF_ENDPOINT, as `huggingface_hub` reads it)."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    check_repo_id(repo_id)
    check_publishable(folder)
    api = HfApi(endpoint=endpoint, token=hub_token())
    try:
        api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
        commit = api.upload_folder(
            folder_path=folder,
            repo_id=repo_id,
            repo_type="model",
            commit_message="EAGLE-3 draft exported by eagle3-pipeline",
            ignore_patterns=IGNORED,
        )
    except HfHubHTTPError as exc:  # the Hub's answer (no write access, a bad card) is the user's to act on
        raise HubError(f"pushing {folder} to {repo_id} failed: {exc}") from None
    return commit.commit_url
