"""The docs site's generated pages (docs/hooks.py): every configuration field and every command is in its
reference with what a user needs, and the Benchmarks page's table is the lab log's own."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import typer.main

from cli.main import app
from eagle3_core.phases import config_fields

REPO = Path(__file__).resolve().parents[3]
spec = importlib.util.spec_from_file_location("docs_hooks", REPO / "docs" / "hooks.py")
hooks = importlib.util.module_from_spec(spec)
spec.loader.exec_module(hooks)


def reference_rows(markdown: str) -> dict[str, list[str]]:
    """Table rows by their first cell's code span: {"training.lr": [cells...]}."""
    rows = {}
    for line in markdown.splitlines():
        if line.startswith("| `"):
            cells = [cell.strip() for cell in line.strip("|").split(" | ")]
            rows[cells[0].strip("`").split("`")[0]] = cells
    return rows


def test_every_config_field_has_its_type_default_description_and_phases():
    rows = reference_rows(hooks.config_reference())
    for path, info in config_fields():
        assert path in rows, f"{path} is missing from the configuration reference"
        _, kind, default, description, phases = rows[path]
        assert kind and default and description == hooks.cell(info.description) and phases, path
    assert rows["training.lr"][4] == "**training**: content"
    assert rows["server.port"][4] == "sampling: operational, extraction: operational, evaluation: operational"
    assert rows["sampling.max_tokens"][1:3] == ["`int`", "`384`"]


def test_every_command_and_option_is_in_the_cli_reference():
    reference = hooks.cli_reference()
    for name, command in typer.main.get_command(app).commands.items():
        assert f"## `eagle3 {name}`" in reference
        for param in command.params:
            assert f"`{param.opts[0]}`" in reference, f"eagle3 {name} {param.opts[0]}"


def test_the_benchmarks_table_is_the_lab_logs_and_its_absence_fails_the_build():
    standing = hooks.where_things_stand(hooks.LAB_LOG.read_text())
    assert standing.startswith("| benchmark |") and "\n## " not in standing
    page = (REPO / "docs" / "benchmarks.md").read_text()
    assert standing in hooks.on_page_markdown(page, None, None, None)
    with pytest.raises(ValueError, match="Where things stand"):
        hooks.where_things_stand("# Benchmark results\n\n## Something else\n")
