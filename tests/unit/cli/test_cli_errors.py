"""Every `eagle3` command shares one prologue: a mistake the user can make (a missing path, a wrong draft
folder) ends it with one `error:` line and exit status 1, not a traceback; `--debug` shows the traceback."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

from cli.main import app
from eagle3_core.draft.export import load_exported
from eagle3_core.files import UnreadableFile
from tests.helpers.extraction_fixtures import build_sample_set


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


def test_a_lost_gpu_slot_lease_is_one_error_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The Prefect server stops answering while a phase command holds the slot: the renewal thread stops the
    phase (tests/unit/tasks/gpu_slot) and the command ends with the reason, not a traceback."""
    from tasks.gpu_slot import SlotLost, kept_lease

    def unreachable() -> None:
        raise ConnectionError("the Prefect API at http://127.0.0.1:1/api is unreachable")

    def phase_losing_its_lease(*args: object) -> None:
        with kept_lease(unreachable, lease_s=0.2, what="the gpu slot"):
            for _ in range(500):  # Python steps: the keeper's exception arrives between two of them
                time.sleep(0.01)

    monkeypatch.setattr("eagle3_core.target.prepare.prepare_target", phase_losing_its_lease)
    result = CliRunner().invoke(app, ["prepare-target", "--set", f"run_dir={tmp_path / 'run'}"])
    line = one_error_line(result)
    assert line.startswith("error: the gpu slot: its lease could not be renewed for 0 s (last failure: the Prefect")
    assert SlotLost.__name__ not in result.output


def test_debug_keeps_the_traceback():
    result = CliRunner().invoke(app, ["--debug", "prepare-target", "/nope/model"])
    assert isinstance(result.exception, FileNotFoundError)
    assert "error:" not in result.output


def one_error_line(result: Result) -> str:
    """The single `error:` line a mistake ends with (exit status 1, no traceback), its wrapping undone."""
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit), "the error escaped as a traceback"
    [line] = [line for line in result.output.splitlines() if line.strip()]
    assert line.startswith("error: ") and "Traceback" not in result.output
    return line


@pytest.mark.parametrize(
    ("config_json", "problem"),
    [
        ('{"architectures": [', "not valid JSON (Expecting value at line 2 column 1)"),
        ("[1, 2]", "holds a JSON list, not an object"),
        ('{"architectures": ["LlamaForCausalLM"]}', "not an EAGLE-3 draft (architectures ['LlamaForCausalLM']"),
    ],
)
def test_a_draft_folder_with_a_broken_config_is_one_error_line_naming_the_file(tmp_path, config_json, problem):
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text(config_json + "\n")
    (draft / "model.safetensors").write_bytes(b"")
    result = CliRunner().invoke(app, ["evaluate", "--draft", str(draft), "--set", f"run_dir={tmp_path / 'run'}"])
    line = one_error_line(result)
    assert line.startswith(f"error: {draft / 'config.json'}: {problem}")
    assert "eagle3 export --out DIR" in line
    assert not (tmp_path / "run").exists()  # refused before the run folder got a line


def test_a_warm_start_folder_with_a_broken_config_names_the_file(tmp_path):
    """`training.warm_start` is read by the same reader: the training phase refuses it by name too."""
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(UnreadableFile, match=rf"^{tmp_path / 'config.json'}: not valid JSON"):
        load_exported(tmp_path)


def test_a_corrupt_training_state_to_export_is_one_error_line(tmp_path, tiny_llama, smollm2_target):
    run_dir = tmp_path / "run"
    build_sample_set(run_dir / "samples", smollm2_target.root_path, num_ok=2)
    settings = [f"run_dir={run_dir}", f"target.model={tiny_llama.root}", "extraction.backend=hf",
                "sampling.holdout_fraction=0"]  # fmt: skip
    sets = [arg for setting in settings for arg in ("--set", setting)]
    for step in ("extract", "vocab"):
        assert CliRunner().invoke(app, [step, *sets]).exit_code == 0
    state = tmp_path / "step-00000004.pt"
    state.write_bytes(b"not a torch file")
    result = CliRunner().invoke(app, ["export", "--out", str(tmp_path / "out"), "--state", str(state), *sets])
    line = one_error_line(result)
    assert line.startswith(f"error: {state}: not a readable training state")
    latest = run_dir / "draft" / "state" / "latest.json"  # the newest state, when --state is not given
    latest.parent.mkdir(parents=True)
    latest.write_text('{"file": "step-0000')
    result = CliRunner().invoke(app, ["export", "--out", str(tmp_path / "out"), *sets])
    assert one_error_line(result).startswith(f"error: {latest}: not valid JSON")
    assert not (tmp_path / "out").exists()


def test_a_config_mistake_exits_1_naming_the_field_in_the_users_words(tmp_path):
    """A union field (`epochs: auto | a positive number`) is reported by its own path, the members' reasons
    joined, without pydantic's names for the members."""
    config = tmp_path / "run.yaml"
    config.write_text("training:\n  epochs: -1\n")
    result = CliRunner().invoke(app, ["train", "--config", str(config)])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit)
    assert result.output.splitlines() == [
        f"error: invalid configuration in {config}:",
        "  training.epochs: Input should be 'auto' or greater than 0 (got -1)",
    ]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["evaluate", "--bogus"], "error: No such option: --bogus. See `eagle3 evaluate --help`."),
        (
            ["prepare-target", "a", "b"],
            "error: Got unexpected extra argument(s) (b). See `eagle3 prepare-target --help`.",
        ),
        (["sampel"], "error: No such command 'sampel'. Did you mean 'sample'? See `eagle3 --help`."),
        (["--nope", "config"], "error: No such option: --nope. See `eagle3 --help`."),
    ],
)
def test_a_usage_mistake_is_one_error_line_with_exit_status_1(args, message):
    assert one_error_line(CliRunner().invoke(app, args, prog_name="eagle3")) == message


@pytest.mark.parametrize("command", ["prepare-target", "sample", "extract", "vocab", "train", "export", "evaluate"])
def test_a_command_refused_by_its_checks_writes_no_run_folder(tmp_path, monkeypatch, command):
    """In a fresh working directory, a wrong target or config leaves no `runs/default` behind."""
    monkeypatch.chdir(tmp_path)
    options = ["--out", "out"] if command == "export" else []
    for setting in ("target.model=/nope/model", "server.dtype=bf16"):
        result = CliRunner().invoke(app, [command, *options, "--set", setting])
        assert result.exit_code == 1 and "error: " in result.output, result.output
    assert list(tmp_path.iterdir()) == []
