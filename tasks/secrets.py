"""The server's API key from a Prefect Secret block (`server.api_key_secret`), copied into this process's
environment under the variable `ServerConfig.api_key_variable()` names, where eagle3_core reads it like a key
set by the user. The key itself never enters the config, so config dumps, events, manifests and artifacts
carry only the block's and the variable's names."""

from __future__ import annotations

import os

from eagle3_core.config import ServerConfig


def export_api_key(server: ServerConfig) -> None:
    """Load the Secret block named by `server.api_key_secret` (if any) into the key's variable."""
    if server.api_key_secret is None:
        return
    from prefect.blocks.system import Secret

    variable = server.api_key_variable()
    try:
        key = Secret.load(server.api_key_secret, _sync=True).get()
    except ValueError as exc:
        raise ValueError(f"server.api_key_secret: no Prefect Secret block {server.api_key_secret!r}: {exc}") from None
    os.environ[variable] = str(key)
