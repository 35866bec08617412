"""Every `eagle3` command shares one prologue: a mistake the user can make (a missing path, a wrong draft
folder) ends it with one `error:` line and exit status 1, not a traceback; `--debug` shows the traceback."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from cli.main import app


def test_a_missing_target_folder_is_one_error_line():
    result = CliRunner().invoke(app, ["prepare-target", "/nope/model"])
    assert result.exit_code == 1
    assert result.output.startswith("error: target.model='/nope/model' is neither an embedded target")
    assert len(result.output.strip().splitlines()) == 1 and "Traceback" not in result.output


def test_an_empty_draft_folder_is_one_error_line(tmp_path: Path):
    empty = tmp_path / "draft"
    empty.mkdir()
    result = CliRunner().invoke(app, ["evaluate", "--draft", str(empty), "--set", f"run_dir={tmp_path / 'run'}"])
    assert result.exit_code == 1
    assert result.output.startswith(f"error: {empty}: neither a draft checkpoint nor an export folder")
    assert "Traceback" not in result.output


def test_debug_keeps_the_traceback():
    result = CliRunner().invoke(app, ["--debug", "prepare-target", "/nope/model"])
    assert isinstance(result.exception, FileNotFoundError)
    assert "error:" not in result.output
