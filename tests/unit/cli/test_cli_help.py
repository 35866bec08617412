"""`eagle3 --help` reads as the pipeline runs (commands in order), every option says what it does and flags
show no value type; `eagle3 config --explain` is the resolved config, every field described and its role in
each phase's cache key stated, and still a config file one can load."""

from __future__ import annotations

import re

import pytest
import yaml
from typer._click.core import Context
from typer.main import get_command
from typer.testing import CliRunner

from cli.main import app
from cli.pipeline_group import COMMAND_ORDER, in_pipeline_order
from eagle3_core.config import PipelineConfig, load_config
from eagle3_core.phases import config_fields

PIPELINE = ["config", "prepare-target", "sample", "extract", "vocab", "train", "export", "evaluate", "run", "deploy"]


def test_help_lists_the_commands_in_pipeline_order():
    result = CliRunner().invoke(app, ["--help"], terminal_width=120)
    assert result.exit_code == 0
    listed = re.findall(r"^│ ([a-z][a-z-]*) ", result.output, flags=re.MULTILINE)
    assert [name for name in listed if name in PIPELINE] == PIPELINE


def test_commands_added_later_slot_into_the_order():
    """doctor, plan and serve (added by their own branches) take their place; an unknown one goes last."""
    shuffled = ["deploy", "serve", "newcomer", "run", "plan", *reversed(PIPELINE[:-2]), "doctor"]
    ordered = in_pipeline_order(shuffled)
    assert ordered[:3] == ["doctor", "config", "plan"] and ordered[-1] == "newcomer"
    assert ordered.index("serve") == ordered.index("evaluate") + 1
    assert [name for name in ordered if name in PIPELINE] == PIPELINE
    assert set(PIPELINE) <= set(COMMAND_ORDER)


@pytest.mark.parametrize("command", [None, *PIPELINE])
def test_every_option_says_what_it_does_and_flags_take_no_value(command):
    """Each option has help text, flags show no `<bool>`, and the command's help flows as one paragraph."""
    group = get_command(app)
    target = group if command is None else group.commands[command]
    for param in target.get_params(Context(target)):
        assert getattr(param, "help", None), f"{command} {param.name}: no help text"
    assert "\n" not in (target.help or ""), "a docstring's line breaks would break the help mid-sentence"
    args = ["--help"] if command is None else [command, "--help"]
    text = CliRunner().invoke(app, args, terminal_width=120).output
    assert "<bool>" not in text
    assert ("--explain" in text) == (command == "config")


def test_config_explain_describes_every_field_and_the_phases_keyed_on_it(tmp_path):
    result = CliRunner().invoke(app, ["config", "--explain", "--set", "server.dtype=float32"])
    assert result.exit_code == 0, result.output
    text = result.output
    for path, info in config_fields():
        assert " ".join(info.description.split()[:4]) in " ".join(text.replace("#", " ").split()), path
    lines = text.splitlines()
    at = lines.index("  dtype: float32")  # server.dtype: its role in each phase reading it, just above
    assert lines[at - 1] == "  # roles: content in sampling; vllm in evaluation; operational in extraction"
    assert "# roles: operational in every phase" in lines[lines.index("run_dir: runs/default") - 1]
    assert "keyed only when not 4.0" in text  # training.max_epochs, added after runs were keyed
    saved = tmp_path / "explained.yaml"
    saved.write_text(text)
    assert isinstance(yaml.safe_load(saved.read_text()), dict)
    assert load_config(saved) == load_config(None, ["server.dtype=float32"]) != PipelineConfig()
