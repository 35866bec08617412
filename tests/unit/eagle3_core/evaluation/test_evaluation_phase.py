"""The evaluation phase end to end on a tiny target (measurement (a) only, no vLLM server): report,
plot and manifest written, the guard failing after writing them, resume and cache hits."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from eagle3_core.artifacts import EvalReport, TargetModel
from eagle3_core.config import PipelineConfig
from eagle3_core.evaluation.phase import evaluate_draft
from eagle3_core.evaluation.report import AcceptanceBelowFloor
from eagle3_core.events import CACHE_HIT, RESUME, WEIGHT_LOAD, RunEvents
from tests.helpers.evaluation_fixtures import exported_checkpoint, random_draft, varied_tiny_target
from tests.helpers.extraction_fixtures import build_sample_set
from tests.helpers.served_targets import pinned_dtypes


@pytest.fixture(scope="module")
def setup(tiny_llama: TargetModel, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("evalphase")
    target = varied_tiny_target(tiny_llama, root / "target")
    sample_set = build_sample_set(root / "samples", target.root_path, num_ok=12)
    checkpoint = exported_checkpoint(random_draft(target), root / "draft")
    return target, sample_set, checkpoint


def make_config(run_dir: Path, **evaluation) -> PipelineConfig:
    """Compute dtypes pinned: (a)'s lossless check below claims identity, which bfloat16 does not promise."""
    return PipelineConfig.model_validate(pinned_dtypes({
        "run_dir": str(run_dir),
        "sampling": {"holdout_fraction": 0.5},
        "evaluation": {"max_prompts": 2, "max_new_tokens": 12, "with_vllm": False, "lossless_check_prompts": 1,
                       "cpu_threads": 1, **evaluation},
    }))  # fmt: skip


def test_random_draft_trips_the_guard_after_writing_the_report(setup, tmp_path: Path) -> None:
    target, sample_set, checkpoint = setup
    config = make_config(tmp_path)
    events = RunEvents(tmp_path)
    with pytest.raises(AcceptanceBelowFloor) as failure:
        evaluate_draft(config, checkpoint, target, sample_set, events)
    message = str(failure.value)
    for cause in ("layer ids", "weight names", "d2t", "chat template", "transformers (a) 0.", "vLLM (b) —"):
        assert cause in message
    eval_dir = tmp_path / "eval"
    report = EvalReport.load(eval_dir)
    report.validate(deep=True)
    assert report.guard_failure and report.guard_failure in message
    assert {f.path for f in report.files} >= {"report.md", "acceptance.png", "transformers-humaneval.json"}
    assert (eval_dir / "acceptance.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    markdown = (eval_dir / "report.md").read_text()
    assert "| humaneval |" in markdown and "| holdout |" in markdown and "| all |" in markdown
    assert "likely causes" in markdown

    hf = report.measurements["transformers"]
    assert hf["k"] == 5 and set(hf["sets"]) == {"humaneval", "holdout", "all"}
    assert hf["sets"]["all"]["prompts"] == hf["sets"]["humaneval"]["prompts"] + hf["sets"]["holdout"]["prompts"]
    assert hf["sets"]["all"]["identical_to_greedy"] == "2/2"
    assert 0 < hf["sets"]["all"]["draft_share"] < 1
    assert report.num_speculative_tokens == 3 and len(report.per_position) == 3 and len(report.tau_by_k) == 5
    assert report.acceptance_length == pytest.approx(report.tau_by_k[2])
    assert report.measurements["vllm"] == {"skipped": "evaluation.with_vllm is false"}
    assert events.count(WEIGHT_LOAD, "evaluation") == 1

    # A re-run loads nothing and fails again from the saved numbers.
    with pytest.raises(AcceptanceBelowFloor):
        evaluate_draft(config, checkpoint, target, sample_set, events)
    assert events.count(CACHE_HIT, "evaluation") == 1 and events.count(WEIGHT_LOAD, "evaluation") == 1

    # A lower floor re-judges the saved measurements without measuring again.
    passed = evaluate_draft(make_config(tmp_path, acceptance_floor=0.0), checkpoint, target, sample_set, events)
    assert passed.guard_failure is None and passed.acceptance_length == report.acceptance_length
    assert events.count(RESUME, "evaluation") == 2 and events.count(WEIGHT_LOAD, "evaluation") == 1
    assert "passed" in (eval_dir / "report.md").read_text()

    # A vLLM-only field (concurrency) changes the report's key but not measurement (a)'s.
    again = evaluate_draft(make_config(tmp_path, acceptance_floor=0.0, concurrency=8), checkpoint, target,
                           sample_set, events)  # fmt: skip
    assert again.acceptance_length == report.acceptance_length
    assert events.count(RESUME, "evaluation") == 4 and events.count(WEIGHT_LOAD, "evaluation") == 1


def test_a_held_out_prompt_seen_in_training_fails_before_measuring(setup, tmp_path: Path) -> None:
    from eagle3_core.evaluation.prompts import PromptOverlapError
    from tests.helpers.extraction_fixtures import PROMPTS

    target, _, checkpoint = setup
    # 24 rows over 12 distinct questions: every question is both held out and trained on somewhere.
    duplicated = build_sample_set(tmp_path / "samples", target.root_path, num_ok=2 * len(PROMPTS))
    events = RunEvents(tmp_path)
    with pytest.raises(PromptOverlapError, match="== training row"):
        evaluate_draft(make_config(tmp_path), checkpoint, target, duplicated, events)
    assert events.count(WEIGHT_LOAD) == 0


def test_cli_evaluate_exits_1_when_the_guard_fails_and_0_when_it_passes(setup, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from cli.main import app

    target, _, checkpoint = setup
    settings = [f"run_dir={tmp_path}", f"target.model={target.root}", "evaluation.with_vllm=false",
                "evaluation.max_prompts=1", "evaluation.max_new_tokens=8", "evaluation.cpu_threads=1"]  # fmt: skip
    args = ["evaluate", "--draft", str(checkpoint.root_path / "export")]
    for setting in settings:
        args += ["--set", setting]
    failed = CliRunner().invoke(app, args)
    assert failed.exit_code == 1, failed.output
    output = " ".join(failed.output.split())  # rich wraps long lines
    assert "acceptance guard failed" in output and "measuring HumanEval only" in output
    passed = CliRunner().invoke(app, [*args, "--set", "evaluation.acceptance_floor=0"])
    assert passed.exit_code == 0, passed.output
    assert "tau (a) at k=3: 1.000" in " ".join(passed.output.split())
    assert EvalReport.load(tmp_path / "eval").measurements["transformers"]["sets"].keys() == {"humaneval"}


def test_nothing_to_measure_is_refused_by_the_config(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="both off: nothing would be measured"):
        make_config(tmp_path, with_transformers=False)
