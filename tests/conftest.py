"""Shared fixtures, each built once per test session (once per xdist worker): the real embedded target
(converted once per machine), tiny random targets, the shared vLLM servers (`served_targets.py`), one
throwaway Prefect API (a temporary database and server) for the tests that need not be isolated, and, where
EAGLE3_TEST_POSTGRES is set, one Prefect server on PostgreSQL for the tests whose workers share a server."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from prefect.testing.utilities import prefect_test_harness

from eagle3_core.artifacts import TargetModel
from eagle3_core.config import TargetConfig
from eagle3_core.events import RunEvents
from eagle3_core.target.prepare import describe_folder, prepare_target
from tests.helpers.postgres import prefect_server_on_postgres
from tests.helpers.served_targets import ServedTargets
from tests.helpers.tiny_targets import build_tiny_target


@pytest.fixture(scope="session")
def smollm2_target(tmp_path_factory: pytest.TempPathFactory) -> TargetModel:
    """The real SmolLM2-135M-Instruct folder (converted from the packaged GGUF on first use)."""
    return prepare_target(TargetConfig(), RunEvents(tmp_path_factory.mktemp("prepare")))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory, smollm2_target: TargetModel) -> TargetModel:
    """A randomly initialised 8-layer Llama with SmolLM2's tokenizer."""
    out = build_tiny_target(tmp_path_factory.mktemp("tiny") / "llama", smollm2_target.root_path, "llama")
    return describe_folder(Path(out), "tiny-llama", "local")


@pytest.fixture(scope="session")
def tiny_deepseek(tmp_path_factory: pytest.TempPathFactory, smollm2_target: TargetModel) -> TargetModel:
    """A randomly initialised DeepSeek-V3-shaped target (MLA, MoE): the seeds' Kimi-K2.5 at test size."""
    out = build_tiny_target(tmp_path_factory.mktemp("tiny") / "dsv3", smollm2_target.root_path, "deepseek_v3")
    return describe_folder(Path(out), "tiny-deepseek-v3", "local")


# The throwaway Prefect servers of the tests send no telemetry (offline machines log an error otherwise).
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


@pytest.fixture(scope="session")
def prefect_api():
    """One Prefect test server for the session. A test that reads back everything the API holds (logs,
    artifacts) starts a harness of its own instead."""
    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def postgres_prefect_server(tmp_path_factory: pytest.TempPathFactory):
    """One `prefect server start` on a fresh PostgreSQL database for the session (one per xdist worker that
    asks for it), the server that real workers share: the UI test's and the two-host test's. Skipped without
    EAGLE3_TEST_POSTGRES (a libpq URL of a role that may create databases; `.ci/run` sets it)."""
    admin = os.environ.get("EAGLE3_TEST_POSTGRES")
    if not admin:
        pytest.skip("needs PostgreSQL: set EAGLE3_TEST_POSTGRES (see tests/helpers/postgres.py)")
    with prefect_server_on_postgres(admin, tmp_path_factory.mktemp("prefect-home")) as server:
        yield server


@pytest.fixture(scope="session")
def served(tmp_path_factory: pytest.TempPathFactory):
    """The session's shared vLLM servers: `served.get(target, server_config)`."""
    servers = ServedTargets(tmp_path_factory.mktemp("served"))
    yield servers
    servers.stop_all()
