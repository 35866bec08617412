"""The commands the README and the quickstart page tell a user to type exist, and the files they name are there.

Data-driven from the pages' ```bash blocks: a command added to a page is checked without touching this test,
and a kind of command this test cannot check fails it rather than passing unchecked. What each kind gets:
`make T`: T is a Makefile target; `pip install -e '.[X]'`: X is an extra of pyproject.toml; `eagle3 CMD`: CMD
answers `--help` with exit status 0, and each config it names (`-c FILE`) loads through `eagle3 config`.
Running the commands themselves is left to the suite's flow tests (`make demo` is ten minutes of CPU; the GPU
commands need GPUs). The pages' file references are checked for existence by `test_docs_files`."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.main import app

REPO = Path(__file__).resolve().parents[3]
PAGES = (REPO / "README.md", REPO / "docs" / "quickstart.md")
BASH_BLOCK = re.compile(r"^```bash\n(.*?)^```", re.MULTILINE | re.DOTALL)
MAKE_TARGET = re.compile(r"^([A-Za-z][\w-]*):", re.MULTILINE)
# The keys of pyproject.toml's [project.optional-dependencies] (tomllib is not in Python 3.10's library).
EXTRAS_TABLE = re.compile(r"^\[project\.optional-dependencies\]\n(.*?)^\[", re.MULTILINE | re.DOTALL)
EXTRA = re.compile(r"^([\w-]+)\s*=", re.MULTILINE)


def page_commands(page: Path) -> list[list[str]]:
    """Every command of the page's bash blocks as words: continuations joined, comments dropped, `a && b` split."""
    commands = []
    for block in BASH_BLOCK.findall(page.read_text()):
        for line in block.replace("\\\n", " ").splitlines():
            for command in line.split("&&"):
                if words := shlex.split(command, comments=True):
                    commands.append(words)
    return commands


def config_files(words: list[str]) -> list[str]:
    """The files given to `-c`/`--config`."""
    return [words[i + 1] for i, word in enumerate(words[:-1]) if word in ("-c", "--config")]


def check(words: list[str]) -> None:
    """Fail unless the command exists here as the page says it does."""
    program, *args = words
    if program == "make":
        targets = set(MAKE_TARGET.findall((REPO / "Makefile").read_text()))
        assert set(args) <= targets, f"`{shlex.join(words)}`: no Makefile target {sorted(set(args) - targets)}"
    elif program == "pip" and args[:2] == ["install", "-e"]:
        extras = re.fullmatch(r"\.\[([\w,-]+)\]", args[2]).group(1).split(",")
        declared = EXTRA.findall(EXTRAS_TABLE.search((REPO / "pyproject.toml").read_text()).group(1))
        assert set(extras) <= set(declared), f"`{shlex.join(words)}`: pyproject.toml has no extra {extras}"
    elif program == "eagle3":
        runner = CliRunner()
        helped = runner.invoke(app, [args[0], "--help"])
        assert helped.exit_code == 0, f"`eagle3 {args[0]} --help` exited {helped.exit_code}: {helped.output}"
        for config in config_files(args):
            loaded = runner.invoke(app, ["config", "-c", str(REPO / config)])
            assert loaded.exit_code == 0, f"`{shlex.join(words)}`: {config} does not load: {loaded.output}"
    else:
        raise AssertionError(f"`{shlex.join(words)}`: this test does not know how to check `{program}`; teach it")


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_command_of_the_page_exists(page: Path):
    commands = page_commands(page)
    assert commands, f"{page.name} has no bash block: the test would check nothing"
    failures = []
    for words in commands:
        try:
            check(words)
        except AssertionError as failure:
            failures.append(str(failure).splitlines()[0])
    assert not failures, f"{page.name}:\n" + "\n".join(failures)


def test_an_unknown_command_or_target_fails_the_check():
    with pytest.raises(AssertionError, match="no Makefile target"):
        check(["make", "no-such-target"])
    with pytest.raises(AssertionError, match="--help"):
        check(["eagle3", "no-such-command"])
    with pytest.raises(AssertionError, match="no extra"):
        check(["pip", "install", "-e", ".[no-such-extra]"])
    with pytest.raises(AssertionError, match="does not know"):
        check(["curl", "https://example.com"])
