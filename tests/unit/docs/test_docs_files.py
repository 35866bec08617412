"""Every repository path and every configuration field the README, CONTRIBUTING.md and the docs pages name in
backticks exists, so a renamed config, script, module or field cannot leave a page pointing at nothing
(mkdocs --strict checks the links between pages; this checks the names into the code)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from eagle3_core.config import PipelineConfig
from eagle3_core.phases import config_fields

REPO = Path(__file__).resolve().parents[3]
PAGES = (REPO / "README.md", REPO / "CONTRIBUTING.md", *sorted((REPO / "docs").glob("*.md")))
TOP_FOLDERS = ("configs", "bench", "tests", "eagle3_core", "cli", "tasks", "flows", "deployments", "docs", ".ci")
# A path in backticks, possibly followed by `::name` or `:name` (a function in it) or options after a space.
NAMED_PATH = re.compile(rf"`((?:{'|'.join(re.escape(folder) for folder in TOP_FOLDERS)})/[\w./-]*\w)")


# A field in backticks, `section.field` (possibly `section.field: value` or `section.field=value`).
NAMED_FIELD = re.compile(rf"`((?:{'|'.join(PipelineConfig.model_fields)})\.\w+)(?=[`:= ])")


def named_fields(page: Path) -> set[str]:
    """The configuration fields a page names."""
    return set(NAMED_FIELD.findall(page.read_text()))


def named_paths(page: Path) -> set[str]:
    """The repository paths a page names, placeholders (`<run_dir>`, globs) left out."""
    return {path for path in NAMED_PATH.findall(page.read_text()) if not re.search(r"[<*]", path)}


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_path_the_page_names_exists(page: Path):
    missing = sorted(path for path in named_paths(page) if not (REPO / path).exists())
    assert not missing, f"{page.relative_to(REPO)} names paths that do not exist: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_config_field_the_page_names_exists(page: Path):
    fields = {path for path, _ in config_fields()}
    missing = sorted(named_fields(page) - fields)
    assert not missing, f"{page.relative_to(REPO)} names configuration fields that do not exist: {missing}"


def test_a_missing_path_or_field_is_found(tmp_path: Path):
    page = tmp_path / "page.md"
    page.write_text(
        "Run `configs/no-such.yaml` with `bench/quality.py`, in `<run_dir>/eval`; "
        "set `training.no_such_field: 1`, `--set training.lr=1e-3` and `sampling.max_tokens`."
    )
    assert named_paths(page) == {"configs/no-such.yaml", "bench/quality.py"}
    assert named_fields(page) == {"training.no_such_field", "sampling.max_tokens"}
