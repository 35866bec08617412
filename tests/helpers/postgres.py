"""A fresh PostgreSQL database for a test's Prefect server: created through a role that may create databases
(`.ci/run` starts Debian's postgresql and sets EAGLE3_TEST_POSTGRES to its libpq URL)."""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit, urlunsplit


async def recreate(admin_url: str, name: str) -> None:
    import asyncpg

    connection = await asyncpg.connect(admin_url)
    try:
        await connection.execute(f'DROP DATABASE IF EXISTS "{name}"')
        await connection.execute(f'CREATE DATABASE "{name}"')
    finally:
        await connection.close()


def fresh_database(admin_url: str, name: str) -> str:
    """Create (or empty) database `name`; its SQLAlchemy URL for Prefect (`postgresql+asyncpg://`)."""
    asyncio.run(recreate(admin_url, name))
    parts = urlsplit(admin_url)
    return urlunsplit(parts._replace(scheme="postgresql+asyncpg", path=f"/{name}"))
