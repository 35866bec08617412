"""`eagle3 extract` on a tiny target: runs the phase, prints the manifest; a missing SampleSet or a setting
that does not fit the target is a clear error, not a traceback."""

from __future__ import annotations

import json

from typer.testing import CliRunner, Result

from cli.main import app
from eagle3_core.artifacts import HiddenStateSet
from tests.helpers.extraction_fixtures import build_sample_set


def extract_tiny(run_dir, tiny_llama, *overrides: str) -> Result:
    """`eagle3 extract` of `run_dir`'s samples on the tiny target with the hf backend, nothing held out."""
    settings = [f"run_dir={run_dir}", f"target.model={tiny_llama.root}", "extraction.backend=hf",
                "sampling.holdout_fraction=0", *overrides]  # fmt: skip
    return CliRunner().invoke(app, ["extract", *[a for o in settings for a in ("--set", o)]])


def test_extract_command_writes_the_hidden_state_set(tmp_path, tiny_llama, smollm2_target):
    build_sample_set(tmp_path / "run" / "samples", smollm2_target.root_path, num_ok=4)
    result = extract_tiny(tmp_path / "run", tiny_llama, "extraction.samples_per_shard=2")
    assert result.exit_code == 0, result.output
    hidden = HiddenStateSet.load(tmp_path / "run" / "hidden_states")
    assert hidden.samples == 4 and len(hidden.files) == 3  # two shards and the index
    assert f'"digest": "{hidden.digest}"' in result.output
    assert json.loads((tmp_path / "run" / "events.jsonl").read_text().splitlines()[-1])["phase"] == "extraction"


def test_extract_without_samples_names_the_missing_folder(tmp_path):
    result = CliRunner().invoke(app, ["extract", "--set", f"run_dir={tmp_path}"])
    assert result.exit_code == 1
    assert "sample_set.json" in result.output and str(tmp_path) in result.output.replace("\n", "")


def test_layer_ids_past_the_target_end_extract_with_a_message_not_a_traceback(tmp_path, tiny_llama, smollm2_target):
    """Layer ids past the target's depth: the error names the field, nothing is loaded, exit code 1."""
    build_sample_set(tmp_path / "run" / "samples", smollm2_target.root_path, num_ok=2)
    result = extract_tiny(tmp_path / "run", tiny_llama, "extraction.layer_ids=[1, 2, 99]")
    assert result.exit_code == 1, result.output
    message = " ".join(result.output.split())  # the console wraps long lines
    assert "error: extraction.layer_ids: layer ids [1, 2, 99] do not fit a target with 8 layers" in message
    assert isinstance(result.exception, SystemExit), "the error escaped as a traceback"
    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    assert not any(e["event"] == "weight_load" and e["phase"] == "extraction" for e in events)
