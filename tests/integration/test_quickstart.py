"""The quickstart's CPU path, run as the page gives it: every command of the `## The demo on a CPU` section's
bash blocks runs here (`make test` and `make test-unit` are this suite itself: they are left to CI), and the text the
page promises for the second `make demo` (every phase cached, no weight load) is what it prints.

`make demo` runs with `DEMO_CONFIG` pointing at a copy of configs/demo.yaml whose `run_dir` is a temporary
folder: the same make target and recipe, without touching a `runs/demo` the checkout may already hold. The
first `make demo` is the suite's one demo run (the `demo_run` fixture, tests/helpers/demo_run.py), which
other tests read too; the second is this test's own."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.helpers.demo_run import DEMO_COMMAND, READS_DEMO, DemoRun, run_make

pytestmark = [pytest.mark.slow, READS_DEMO]

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "quickstart.md"
CPU_SECTION = re.compile(r"^## The demo on a CPU\n(.*?)(?=^## )", re.MULTILINE | re.DOTALL)
BLOCK = re.compile(r"^```(bash|text)\n(.*?)^```", re.MULTILINE | re.DOTALL)
# This suite (`make test`) and its fast tier: CI runs them, and running them from inside themselves never ends.
RUN_BY_CI = {"make test", "make test-unit"}


def section_blocks(kind: str) -> list[str]:
    section = CPU_SECTION.search(PAGE.read_text())
    assert section, f"{PAGE}: no '## The demo on a CPU' section"
    return [body for block_kind, body in BLOCK.findall(section.group(1)) if block_kind == kind]


def make(command: str, demo_config: Path) -> subprocess.CompletedProcess[str]:
    words = command.split()
    assert words[0] == "make", f"{PAGE}: `{command}` is no make command; teach this test to run it"
    return run_make(command, demo_config)


def test_the_quickstart_cpu_commands_run_and_the_second_demo_is_all_cached(demo_run: DemoRun) -> None:
    commands = [line.strip() for body in section_blocks("bash") for line in body.splitlines() if line.strip()]
    assert DEMO_COMMAND in commands
    for command in commands:
        if command in RUN_BY_CI:
            continue
        # the page's `make demo` is the suite's demo run: the same command, run once for every test reading it
        done = demo_run if command == DEMO_COMMAND else make(command, demo_run.config)
        assert done.returncode == 0, (
            f"`{command}` exited {done.returncode}:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
        )
    assert (demo_run.run_dir / "draft" / "export" / "config.json").is_file()
    assert (demo_run.run_dir / "eval" / "report.md").is_file()

    again = make(DEMO_COMMAND, demo_run.config)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    printed = " ".join(again.stdout.split())  # the summary is wrapped to the terminal's width
    for promised in section_blocks("text"):
        for line in filter(None, (line.strip() for line in promised.splitlines())):
            assert " ".join(line.split()) in printed, (
                f"{PAGE} promises {line!r}; the second `make demo` printed:\n{again.stdout[-3000:]}"
            )
