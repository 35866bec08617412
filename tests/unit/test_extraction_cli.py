"""`eagle3 extract` on a tiny target: runs the phase, prints the manifest; a missing SampleSet is a clear error."""

from __future__ import annotations

import json

from extraction_fixtures import build_sample_set
from typer.testing import CliRunner

from eagle3_core.artifacts import HiddenStateSet
from eagle3_core.cli import app


def test_extract_command_writes_the_hidden_state_set(tmp_path, tiny_llama, smollm2_target):
    build_sample_set(tmp_path / "run" / "samples", smollm2_target.root_path, num_ok=4)
    overrides = [
        f"run_dir={tmp_path / 'run'}", f"target.model={tiny_llama.root}", "extraction.backend=hf",
        "sampling.holdout_fraction=0", "extraction.samples_per_shard=2",
    ]  # fmt: skip
    result = CliRunner().invoke(app, ["extract", *[a for o in overrides for a in ("--set", o)]])
    assert result.exit_code == 0, result.output
    hidden = HiddenStateSet.load(tmp_path / "run" / "hidden_states")
    assert hidden.samples == 4 and len(hidden.files) == 3  # two shards and the index
    assert f'"digest": "{hidden.digest}"' in result.output
    assert json.loads((tmp_path / "run" / "events.jsonl").read_text().splitlines()[-1])["phase"] == "extraction"


def test_extract_without_samples_names_the_missing_folder(tmp_path):
    result = CliRunner().invoke(app, ["extract", "--set", f"run_dir={tmp_path}"])
    assert result.exit_code == 2
    assert "sample_set.json" in result.output and str(tmp_path) in result.output.replace("\n", "")
