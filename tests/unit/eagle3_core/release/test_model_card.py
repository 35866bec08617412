"""The export folder's model card: Hub front matter that parses, the recipe and data of the run, the acceptance
of the evaluation report of this very draft (its numbers, engine, k, prompt sets and date) once the real
evaluation phase wrote one, and serve commands that name the k `eagle3 serve` would serve."""

from __future__ import annotations

import json
import re
import shlex
from datetime import UTC, datetime
from pathlib import Path

import pytest
import yaml

from eagle3_core.artifacts import DraftCheckpoint, TargetModel
from eagle3_core.config import PipelineConfig
from eagle3_core.draft.export import load_exported
from eagle3_core.evaluation.phase import evaluate_draft
from eagle3_core.events import RunEvents
from eagle3_core.release.card import CARD, base_model_id, write_model_card
from eagle3_core.release.commands import fastest_k
from tests.helpers.evaluation_fixtures import exported_checkpoint, random_draft, varied_tiny_target
from tests.helpers.extraction_fixtures import build_sample_set


def parse_card(text: str) -> tuple[dict, str]:
    """(front matter, body) of a card, the front matter read by yaml as the Hub reads it."""
    assert text.startswith("---\n")
    end = text.index("\n---\n", 4)
    return yaml.safe_load(text[4:end]), text[end + 5 :]


def table_row(body: str, header_start: str) -> list[str]:
    """The cells of the first row under the table whose header starts with `header_start`."""
    lines = body.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    return [cell.strip() for cell in lines[header + 2].strip("|").split("|")]


@pytest.fixture(scope="module")
def run(tiny_llama: TargetModel, tmp_path_factory: pytest.TempPathFactory):
    """A run folder with its samples and an exported draft, as training leaves it."""
    root = tmp_path_factory.mktemp("card")
    target = varied_tiny_target(tiny_llama, root / "target")
    run_dir = root / "run"
    sample_set = build_sample_set(run_dir / "samples", target.root_path, num_ok=12)
    checkpoint = exported_checkpoint(random_draft(target), run_dir / "draft")
    config = PipelineConfig.model_validate({
        "run_dir": str(run_dir),
        "sampling": {"holdout_fraction": 0.5, "prompt_files": ["/home/me/prompts/a.jsonl", "prompts/b.parquet"]},
        "evaluation": {"max_prompts": 2, "max_new_tokens": 12, "with_vllm": False, "lossless_check_prompts": 1,
                       "cpu_threads": 1, "acceptance_floor": 0.0, "prompt_sets": ["holdout"]},
    })  # fmt: skip
    return config, target, sample_set, checkpoint


def test_the_card_before_and_after_the_evaluation(run) -> None:
    config, target, sample_set, checkpoint = run
    export = checkpoint.path_of("export")
    card = write_model_card(config, target, checkpoint, export)
    metadata, body = parse_card(card.read_text())
    assert metadata == {
        "base_model": base_model_id(target),
        "library_name": "vllm",
        "tags": ["eagle3", "speculative-decoding"],
        "pipeline_tag": "text-generation",
    }
    assert "Not measured yet" in body and "k = 3: no evaluation report of this draft" in body
    assert "prompt files: a.jsonl, b.parquet" in body and "/home/me" not in card.read_text()  # names, not paths
    assert f"{sample_set.ok} answers of the target to {sample_set.prompts} prompts (1 response per prompt)" in body
    draft = json.loads((export / "config.json").read_text())
    assert f"{draft['draft_vocab_size']} of {draft['vocab_size']} target tokens" in body

    report = evaluate_draft(config, checkpoint, target, sample_set, RunEvents(config.run_dir))  # rewrites the card
    metadata_after, body = parse_card((export / CARD).read_text())
    assert metadata_after == metadata
    k, tau_a, rates, tau_b, engine, speedup = table_row(body, "| k |")
    assert int(k) == report.num_speculative_tokens == 3
    assert float(tau_a) == pytest.approx(report.acceptance_length, abs=5e-4)
    assert [float(r) for r in rates.split(" / ")] == pytest.approx(report.per_position, abs=5e-4)
    assert (tau_b, engine, speedup) == ("—", "not run", "—")  # (b) was off
    today = datetime.now(UTC).date().isoformat()
    assert f"Measured {today} at k = 3, greedy, 12 new tokens, on the prompt sets holdout" in body

    served = fastest_k(report)
    vllm = next(line for line in body.splitlines() if line.startswith("vllm serve"))
    words = shlex.split(vllm)
    speculative = json.loads(words[words.index("--speculative-config") + 1])
    assert words[2] == metadata["base_model"] and speculative["model"] == str(export)
    assert speculative["num_speculative_tokens"] == served.k and f"{served.reason}." in body
    sglang = shlex.split(next(line for line in body.splitlines() if "sglang.launch_server" in line))
    assert sglang[sglang.index("--speculative-num-steps") + 1] == str(served.k)
    assert load_exported(export, target.root_path).config.draft_vocab_size == draft["draft_vocab_size"]


def test_a_report_of_another_draft_is_not_this_drafts_acceptance(run, tmp_path: Path) -> None:
    config, target, _, checkpoint = run
    other = exported_checkpoint(random_draft(target, seed=1), tmp_path / "other")
    assert other.digest != checkpoint.digest
    text = write_model_card(config, target, other, other.path_of("export"), repo_id="org/draft").read_text()
    assert "Not measured yet" in text and "--speculative-draft-model-path org/draft" in text


def test_the_base_model_is_the_hub_id_of_the_target(smollm2_target: TargetModel, tmp_path: Path) -> None:
    assert base_model_id(smollm2_target) == "HuggingFaceTB/SmolLM2-135M-Instruct"
    folder = tmp_path / "local-model"
    folder.mkdir()
    local = TargetModel(root=str(folder), name="local-model", source="local", architecture="LlamaForCausalLM",
                        model_type="llama", num_layers=2, hidden_size=8, vocab_size=10, tie_word_embeddings=False,
                        config_digest="", tokenizer_digest="", chat_template=None)  # fmt: skip
    (folder / "config.json").write_text(json.dumps({"_name_or_path": "acme/big-model"}))
    assert base_model_id(local) == "acme/big-model"
    (folder / "config.json").write_text(json.dumps({"_name_or_path": "/data/models/big"}))
    assert base_model_id(local) == "local-model"


def test_the_sglang_section_warns_of_a_flag_sglang_does_not_read(run, tmp_path: Path) -> None:
    from dataclasses import replace

    from eagle3_core.draft.model import Eagle3Draft

    config, target, _, _ = run
    draft = random_draft(target)
    flagged = Eagle3Draft(replace(draft.config, norm_before_residual=True))
    flagged.load_state_dict(draft.state_dict(), strict=False)
    checkpoint: DraftCheckpoint = exported_checkpoint(flagged, tmp_path / "flagged")
    body = parse_card(write_model_card(config, target, checkpoint, checkpoint.path_of("export")).read_text())[1]
    assert re.search(r"Trained with norm_before_residual, which SGLang does not read", body)
    assert "recipe flags | norm_before_residual |" in body
