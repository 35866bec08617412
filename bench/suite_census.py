"""What the test suite pays for, counted: a pytest plugin for issue 24's "measure before cutting", loaded by
every `make test` (and so every `.ci/run`):

    .venv/bin/python -m pytest -p bench.suite_census --durations=25 ...

At the end of the session it prints, and writes to `<basetemp>/census.json`:
- vLLM engine starts (real `vllm.entrypoints` servers, and the fake engines of the unit tests apart), by phase,
  read from every `events.jsonl` under the base temp directory, so the servers that `eagle3 run` subprocesses
  started count too;
- Prefect servers: `prefect_test_harness` entries in this process, `prefect server start` subprocesses, and the
  `eagle3 run`/`python -m cli run` subprocesses, each of which starts an ephemeral server unless it is given an
  API URL;
- training runs (the phase's "trained N steps" decisions) and GGUF conversions (prepare's "converted" decisions);
- the seconds of each test module (setup, call and teardown of its tests, longest first), also written as
  `<basetemp>/module_seconds.json`: the format of tests/module_seconds.json, which orders the modules for the
  xdist workers (tests/conftest.py); copy it over that file to schedule by the latest run.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
from pathlib import Path

import pytest

SPAWNED: list[list[str]] = []
HARNESS_ENTRIES = 0
MODULE_SECONDS: collections.Counter[str] = collections.Counter()


def record_spawn(argv: object, env: dict | None) -> None:
    """Keep the argv of a subprocess the tests start, and whether it was pointed at a running Prefect API."""
    words = [str(a) for a in argv] if isinstance(argv, (list, tuple)) else str(argv).split()
    api_url = (env if env is not None else os.environ).get("PREFECT_API_URL")
    SPAWNED.append([*words, f"#api={'yes' if api_url else 'no'}"])


def wrap_popen() -> None:
    original = subprocess.Popen.__init__

    def init(self, args, *rest, **kwargs):  # type: ignore[no-untyped-def]
        record_spawn(args, kwargs.get("env"))
        original(self, args, *rest, **kwargs)

    subprocess.Popen.__init__ = init  # type: ignore[method-assign]


def wrap_harness() -> None:
    import contextlib

    import prefect.testing.utilities as utilities

    original = utilities.prefect_test_harness

    @contextlib.contextmanager
    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        global HARNESS_ENTRIES
        HARNESS_ENTRIES += 1
        with original(*args, **kwargs):
            yield

    utilities.prefect_test_harness = counted


def events_under(root: Path) -> list[dict]:
    rows = []
    for path in root.rglob("events.jsonl"):
        for line in path.read_text(errors="replace").splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def is_flow_run(words: list[str]) -> bool:
    joined = " ".join(words)
    return ("eagle3" in joined or "-m cli" in joined) and " run " in f" {joined} "


def decided(decisions: list[dict], phase: str, word: str) -> int:
    return sum(r.get("phase") == phase and word in r.get("message", "") for r in decisions)


def census(root: Path, spawned: list[list[str]], harness_entries: int) -> dict:
    rows = events_under(root)
    starts = [r for r in rows if r.get("event") == "engine_start"]
    real = [r for r in starts if "vllm.entrypoints" in " ".join(map(str, r.get("command") or []))]
    decisions = [r for r in rows if r.get("event") == "decision"]
    flows = [w for w in spawned if is_flow_run(w)]
    return {
        "vllm_engine_starts": len(real),
        "vllm_engine_starts_by_phase": dict(collections.Counter(r.get("phase", "?") for r in real)),
        "fake_engine_starts": len(starts) - len(real),
        "prefect_test_harness_servers": harness_entries,
        "prefect_server_start_subprocesses": sum("server" in w and "start" in w for w in spawned),
        "flow_run_subprocesses": len(flows),
        "flow_run_subprocesses_with_own_ephemeral_server": sum(w[-1] == "#api=no" for w in flows),
        "training_runs": decided(decisions, "training", "trained"),
        "gguf_conversions": decided(decisions, "prepare_target", "converted"),
    }


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests() -> None:
    """Wrap before the conftests import `prefect_test_harness` by name."""
    wrap_popen()
    wrap_harness()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Under xdist the controller gets every worker's reports, so it alone adds up the modules."""
    MODULE_SECONDS[report.nodeid.split("::")[0]] += report.duration


def module_seconds(seconds: collections.Counter[str]) -> dict[str, float]:
    """Seconds per module, longest first, rounded to the second."""
    return {module: round(total) for module, total in seconds.most_common()}


def pytest_sessionfinish(session: pytest.Session) -> None:
    """An xdist worker leaves its process-local counts beside its base temp; the controller (or a run
    without xdist) adds them up and reads the events of every worker."""
    root = session.config._tmp_path_factory.getbasetemp()  # type: ignore[attr-defined]
    worker = getattr(session.config, "workerinput", None)
    if worker is not None:
        part = {"spawned": SPAWNED, "harness_entries": HARNESS_ENTRIES}
        (root.parent / f"census-{worker['workerid']}.json").write_text(json.dumps(part))
        return
    parts = [json.loads(p.read_text()) for p in root.glob("census-*.json")]
    spawned = SPAWNED + [w for p in parts for w in p["spawned"]]
    counts = census(root, spawned, HARNESS_ENTRIES + sum(p["harness_entries"] for p in parts))
    (root / "census.json").write_text(json.dumps(counts, indent=2))
    modules = module_seconds(MODULE_SECONDS)
    (root / "module_seconds.json").write_text(json.dumps(modules, indent=2) + "\n")
    print("\nsuite census:", json.dumps(counts, indent=2))
    print(f"seconds per module ({root / 'module_seconds.json'}):")
    for module, seconds in list(modules.items())[:25]:
        print(f"{seconds:8d}  {module}")
