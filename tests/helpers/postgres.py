"""A Prefect server on a fresh PostgreSQL database, the database Prefect recommends for a server that workers
share: created through a role that may create databases (`.ci/run` starts Debian's postgresql and sets
EAGLE3_TEST_POSTGRES to its libpq URL). `tests/conftest.py` starts one a session (`postgres_prefect_server`)
for the tests that run real workers against it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx

from eagle3_core.serving.engine import free_port

BIN = Path(sys.executable).parent


async def recreate(admin_url: str, name: str, create: bool = True) -> None:
    import asyncpg

    connection = await asyncpg.connect(admin_url)
    try:
        await connection.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        if create:
            await connection.execute(f'CREATE DATABASE "{name}"')
    finally:
        await connection.close()


def fresh_database(admin_url: str, name: str) -> str:
    """Create (or empty) database `name`; its SQLAlchemy URL for Prefect (`postgresql+asyncpg://`)."""
    asyncio.run(recreate(admin_url, name))
    parts = urlsplit(admin_url)
    return urlunsplit(parts._replace(scheme="postgresql+asyncpg", path=f"/{name}"))


def fetch(database_url: str, query: str, *args: Any) -> list[tuple]:
    """The rows of `query` on the database of a SQLAlchemy URL (`postgresql+asyncpg://`)."""
    import asyncpg

    async def rows() -> list[tuple]:
        connection = await asyncpg.connect(urlsplit(database_url)._replace(scheme="postgresql").geturl())
        try:
            return [tuple(row) for row in await connection.fetch(query, *args)]
        finally:
            await connection.close()

    return asyncio.run(rows())


@dataclass(frozen=True)
class PrefectServer:
    base: str  # the UI; the API is under /api
    database: str  # PREFECT_API_DATABASE_CONNECTION_URL
    env: dict[str, str]  # for clients and workers of it: PREFECT_API_URL, PREFECT_HOME

    @property
    def api(self) -> str:
        return f"{self.base}/api"


def wait_healthy(api: str, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{api}/health", timeout=2).json() is True:
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(1)
    raise AssertionError(f"prefect server at {api} never became healthy")


def drain_prefect_workers() -> None:
    """Send what this process's Prefect log and event workers still hold, as `prefect_test_harness` does
    before it stops its server: a flow run's last log, left for a server that had stopped, held the
    interpreter's exit for 70 s of connection retries."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=30)
    EventsWorker.drain_all(timeout=30)


@contextlib.contextmanager
def prefect_server_on_postgres(admin_url: str, home: Path) -> Iterator[PrefectServer]:
    """`prefect server start` on 127.0.0.1 with a fresh database `prefect_<port>` (one per server, so the
    servers of two xdist workers never share one), dropped when the server has stopped."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    name = f"prefect_{port}"
    database = fresh_database(admin_url, name)
    env = {
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_API_DATABASE_CONNECTION_URL": database,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_UI_API_URL": f"{base}/api",
    }
    command = [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)]
    server = subprocess.Popen(command, env=env)
    try:
        wait_healthy(f"{base}/api")
        yield PrefectServer(base, database, {**env, "PREFECT_API_URL": f"{base}/api"})
    finally:
        drain_prefect_workers()
        server.terminate()
        server.wait(timeout=60)
        asyncio.run(recreate(admin_url, name, create=False))
