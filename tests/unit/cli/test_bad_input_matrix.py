"""The bad-input and fault matrix: every row is an input or fault a user meets, the `eagle3` command that meets
it, and the one `error:` line it must end with (exit status 1, no traceback), before any weight loads; and every
file that existed before the command (the run folder's, the config's, the target's) is unchanged after it.

A new case is one more `Case` in ROWS (tests/helpers/bad_input.py says what a row holds). Rows run on the tiny
Llama target and no engine; a row that needs finished upstream work (samples, hidden states, a vocab) says
`upstream=True` and gets a copy of one such run folder, made once for the module."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from cli.main import app
from tests.helpers.bad_input import Case, Workspace, changed_files, error_text, files_state, run_dir_holder
from tests.helpers.evaluation_fixtures import exported_checkpoint, random_draft
from tests.helpers.extraction_fixtures import build_sample_set

SETTINGS = ["target.model={target}", "run_dir={run}", "extraction.backend=hf", "sampling.holdout_fraction=0"]
SECRET = "hf_never-in-any-output"


def writer_beside(*command: str, folder: str = ""):
    """Another process writing the run folder (`folder` under it) as `command` does."""

    def fault(ws: Workspace) -> None:
        holder = run_dir_holder(ws.run / folder, list(command))
        ws.cleanups.append(lambda: (holder.kill(), holder.wait()))
        (ws.tmp / "holder.pid").write_text(str(holder.pid))

    return fault


def write(relative: str, text: str):
    def fault(ws: Workspace) -> None:
        path = ws.tmp / ws.fill(relative)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)

    return fault


def edit_target_config(change):
    def fault(ws: Workspace) -> None:
        path = ws.target / "config.json"
        path.write_text(json.dumps(change(json.loads(path.read_text()))))

    return fault


def without(*keys: str):
    return lambda config: {k: v for k, v in config.items() if k not in keys}


def remove_tokenizer(ws: Workspace) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (ws.target / name).unlink()


class RunsCode:
    """A pickle that runs code when unpickled: it would leave `marker`."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def evil_state(relative: str):
    def fault(ws: Workspace) -> None:
        torch.save({"model": RunsCode(ws.tmp / "code-ran")}, ws.tmp / relative)

    return fault


def no_code_ran(ws: Workspace) -> None:
    assert not (ws.tmp / "code-ran").exists(), "the state's pickle ran its code"
    assert not (ws.tmp / "out").exists()


def draft_without_hidden_size(ws: Workspace) -> None:
    from eagle3_core.target.prepare import describe_folder

    export = exported_checkpoint(random_draft(describe_folder(ws.target, "tiny", "local")), ws.tmp / "draft")
    config = export.path_of("export") / "config.json"
    config.write_text(json.dumps(without("hidden_size")(json.loads(config.read_text()))))


def empty_sample_set(ws: Workspace) -> None:
    build_sample_set(ws.run / "samples", ws.target, num_ok=0)


def run_dir_file(ws: Workspace) -> None:
    ws.run.parent.mkdir(parents=True, exist_ok=True)
    ws.run.write_text("a file where the run folder should be")


OUTSIDE = '{"file": "../../../evil.pt"}'  # latest.json naming a file three folders up
DUPLICATE_SECTIONS = "training:\n  lr: 1.0e-4\nsampling:\n  max_prompts: 4\ntraining:\n  lr: 2.0e-4\n"
ROWS = [
    # the configuration
    Case("duplicate YAML sections", ["sample", "-c", "{tmp}/run.yaml"],
         r"run\.yaml line 5: training is given twice \(first at line 1\)", write("run.yaml", DUPLICATE_SECTIONS)),
    Case("duplicate YAML keys", ["sample", "-c", "{tmp}/run.yaml"], r"run\.yaml line 3: lr is given twice",
         write("run.yaml", "training:\n  lr: 1.0e-4\n  lr: 2.0e-4\n")),
    Case("--set value with a YAML comment", ["sample", "--set", "training.lr=3e-4 #was 1e-4"],
         r"YAML reads ` #\.\.\.` as a comment, so the value would be '3e-4': quote the value"),
    Case("empty run_dir", ["sample", "--set", "run_dir="], r"run_dir: empty: name a folder"),
    Case("timeouts_s of no phase", ["sample", "--set", "orchestration.timeouts_s.sampleing=60"],
         r"orchestration\.timeouts_s: sampleing: not a phase \(phases: prepare_target, sampling"),
    Case("negative timeout", ["sample", "--set", "orchestration.timeouts_s.sampling=-1"],
         r"orchestration\.timeouts_s\.sampling: Input should be greater than 0"),
    Case("a token's value in server.env", ["sample", "--set", f"server.env.HF_TOKEN={SECRET}"],
         r"server\.env: HF_TOKEN: a secret's value is refused in the config .* write `HF_TOKEN: \$HF_TOKEN`"),
    Case("user and password in server.url", ["sample", "--set", f"server.url=http://me:{SECRET}@127.0.0.1:9/v1"],
         r"server\.url: a user name or password in the URL is refused"),
    Case("both evaluation measurements off", ["evaluate", "--set", "evaluation.with_vllm=false", "--set",
         "evaluation.with_transformers=false"], r"evaluation: with_transformers and with_vllm are both off"),
    # the target
    Case("Hub id huggingface_hub rejects", ["prepare-target", "org/na..me"],
         r"target\.model 'org/na\.\.me': not a Hub id huggingface_hub accepts \(Cannot have -- or \.\."),
    Case("corrupt target config.json", ["prepare-target"], r"{target}/config\.json: not valid JSON",
         write("target/config.json", '{"architectures": ['), own_target=True),
    Case("corrupt target config.json, eagle3 plan", ["plan"], r"{target}/config\.json: not valid JSON",
         write("target/config.json", '{"architectures": ['), own_target=True),
    Case("corrupt target config.json, eagle3 doctor", ["doctor"], r"{target}/config\.json: not valid JSON",
         write("target/config.json", '{"architectures": ['), own_target=True),
    Case("target config.json missing keys", ["sample"], r"{target}/config\.json: no num_hidden_layers, hidden_size",
         edit_target_config(without("hidden_size", "num_hidden_layers")), own_target=True),
    Case("corrupt target tokenizer_config.json", ["prepare-target"], r"{target}/tokenizer_config\.json: not valid JSON",
         write("target/tokenizer_config.json", '{"chat_template": '), own_target=True),
    Case("target without tokenizer", ["prepare-target"], r"{target}: no tokenizer \(tokenizer\.json, tokenizer\.model",
         remove_tokenizer, own_target=True),
    # servers, drafts and data
    Case("unreachable external server", ["sample", "--set", "server.engine=external", "--set",
         "server.url=http://127.0.0.1:9/v1", "--set", "sampling.max_prompts=2"],
         r"the external server at http://127\.0\.0\.1:9 does not answer .* fix server\.url"),
    Case("draft config without hidden_size", ["evaluate", "--draft", "{tmp}/draft/export"],
         r"{tmp}/draft/export/config\.json: no hidden_size", draft_without_hidden_size),
    Case("SampleSet without an ok row, vocab", ["vocab"], r"{run}/samples: the SampleSet holds no ok row",
         empty_sample_set),
    Case("SampleSet without an ok row, extract", ["extract"], r"{run}/samples: the SampleSet holds no ok row",
         empty_sample_set),
    Case("Hub repo id the Hub rejects", ["export", "--push-to-hub", "org/name-"],
         r"--push-to-hub 'org/name-': not a repo id the Hub accepts"),
    # the run folder
    Case("run_dir is a file", ["sample"], r"run_dir {run} is a file, not a folder", run_dir_file),
    Case("a second eagle3 run", ["run"], r"run_dir {run} is in use by pid \d+ on .*`eagle3 run --config a\.yaml`",
         writer_beside("eagle3", "run", "--config", "a.yaml")),
    Case("sample beside a running eagle3 run", ["sample"], r"run_dir {run} is in use by pid \d+ .*`eagle3 run`",
         writer_beside("eagle3", "run")),
    Case("extract beside a running sample", ["extract"], r"run_dir {run} is in use by pid \d+ .*`eagle3 sample`",
         writer_beside("eagle3", "sample"), upstream=True),
    Case("a second eagle3 serve", ["serve", "--draft", "{tmp}/draft"],
         r"run_dir {run}/serve is in use by pid \d+ .*`eagle3 serve`",
         writer_beside("eagle3", "serve", folder="serve")),
    # training states: code never runs
    Case("export --state of a pickle that runs code", ["export", "--out", "{tmp}/out", "--state", "{tmp}/evil.pt"],
         r"{tmp}/evil\.pt: not a readable training state \(Trying to load unsupported GLOBAL posix\.system",
         evil_state("evil.pt"), upstream=True, check=no_code_ran),
    Case("latest.json naming a file outside its folder", ["export", "--out", "{tmp}/out"],
         r"{run}/draft/state/latest\.json: names no state file of this folder \('\.\./\.\./\.\./evil\.pt'\)",
         lambda ws: (evil_state("evil.pt")(ws), write("run/draft/state/latest.json", OUTSIDE)(ws)),
         upstream=True, check=no_code_ran),
]  # fmt: skip


@pytest.fixture(scope="module")
def upstream_run(tmp_path_factory: pytest.TempPathFactory, tiny_llama, smollm2_target) -> Path:
    """A run folder with samples, hidden states (hf backend) and a vocab of the tiny Llama, made once."""
    run = tmp_path_factory.mktemp("upstream") / "run"
    build_sample_set(run / "samples", smollm2_target.root_path, num_ok=2)
    settings = [arg for s in SETTINGS for arg in ("--set", s.format(target=tiny_llama.root, run=run))]
    for step in ("extract", "vocab"):
        result = CliRunner().invoke(app, [step, *settings])
        assert result.exit_code == 0, result.output
    return run


@pytest.mark.parametrize("case", ROWS, ids=[case.name for case in ROWS])
def test_a_bad_input_is_one_error_line_and_loses_nothing(case: Case, tmp_path: Path, tiny_llama, request) -> None:
    target = tiny_llama.root_path
    if case.own_target:
        target = Path(shutil.copytree(target, tmp_path / "target"))
    ws = Workspace(tmp=tmp_path, run=tmp_path / "run", target=target)
    if case.upstream:
        shutil.copytree(request.getfixturevalue("upstream_run"), ws.run)
    try:
        case.fault(ws)
        before = files_state(tmp_path)
        settings = [arg for s in SETTINGS for arg in ("--set", ws.fill(s))]
        command, *rest = [ws.fill(arg) for arg in case.args]
        text = error_text(CliRunner().invoke(app, [command, *settings, *rest]))
        assert re.search(ws.fill(case.error), text), text
        assert SECRET not in text
        assert changed_files(before, tmp_path) == [], "a file that existed before was changed or removed"
        if (tmp_path / "holder.pid").exists():
            assert f"pid {(tmp_path / 'holder.pid').read_text()} " in text, "the refusal names another holder"
        case.check(ws)
    finally:
        for cleanup in ws.cleanups:
            cleanup()


@pytest.mark.parametrize(
    ("setting", "warning"),
    [
        ("orchestration.hosts=2", "orchestration.hosts is 2 but orchestration.rendezvous_host is localhost"),
        ("server.host=0.0.0.0", "server.host 0.0.0.0 serves every network this host is on, without an API key"),
    ],
)
def test_a_setting_most_likely_not_meant_is_warned_about(setting, warning):
    result = CliRunner().invoke(app, ["config", "--set", setting])
    assert result.exit_code == 0, result.output
    assert f"warning: {warning}" in " ".join(result.output.split())
