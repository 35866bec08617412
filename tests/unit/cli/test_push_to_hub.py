"""`eagle3 export --push-to-hub org/name`: the run's export folder (draft, card) published through
`huggingface_hub`'s own `HfApi` to a local HTTP stand-in of the Hub (tests/helpers/fake_hub.py; the real Hub is
out of reach here): the repo created, every file committed byte for byte, the card's front matter validated,
the token from HF_TOKEN sent only as the request's bearer and never printed; bad input is one error line."""

from __future__ import annotations

from pathlib import Path

import huggingface_hub.constants
import pytest
import yaml
from huggingface_hub import constants
from typer.testing import CliRunner

from cli.main import app
from eagle3_core.artifacts import TargetModel
from eagle3_core.release.card import CARD
from tests.helpers.evaluation_fixtures import exported_checkpoint, random_draft
from tests.helpers.fake_hub import FakeHub

TOKEN = "hf_not_a_real_token_123"


@pytest.fixture
def run_dir(tmp_path: Path, tiny_llama: TargetModel) -> Path:
    exported_checkpoint(random_draft(tiny_llama, draft_vocab=256), tmp_path / "run" / "draft")
    return tmp_path / "run"


def push(run_dir: Path, tiny_llama: TargetModel, repo: str) -> list[str]:
    return ["export", "--push-to-hub", repo, "--set", f"run_dir={run_dir}", "--set", f"target.model={tiny_llama.root}"]


def test_the_export_folder_is_published_with_its_card(run_dir, tiny_llama, monkeypatch) -> None:
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    with FakeHub() as hub:
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", hub.url)
        result = CliRunner().invoke(app, push(run_dir, tiny_llama, "acme/tiny-eagle3"))
    assert result.exit_code == 0, result.output
    assert TOKEN not in result.output and "published" in result.output
    assert hub.record.repos == [{"name": "tiny-eagle3", "organization": "acme", "visibility": "public",
                                 "type": "model"}]  # fmt: skip
    export = run_dir / "draft" / "export"
    sent = hub.record.files["acme/tiny-eagle3"]
    assert sorted(sent) == sorted(p.name for p in export.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    assert all(sent[name] == (export / name).read_bytes() for name in sent)
    [validated] = hub.record.validated
    assert validated == (export / CARD).read_text()
    assert yaml.safe_load(validated.split("---\n")[1])["tags"] == ["eagle3", "speculative-decoding"]
    assert "--speculative-draft-model-path acme/tiny-eagle3" in validated  # the card names the repo it is in
    assert hub.record.authorizations and set(hub.record.authorizations) == {f"Bearer {TOKEN}"}


def test_no_token_or_a_bad_repo_id_is_one_error_line(run_dir, tiny_llama, monkeypatch, tmp_path) -> None:
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-stored-token"))  # nor a `hf auth login` one
    result = CliRunner().invoke(app, push(run_dir, tiny_llama, "acme/tiny-eagle3"))
    assert result.exit_code == 1 and result.output.startswith("error: no Hub token: export a token with write")
    assert not (run_dir / "draft" / "export" / CARD).exists()
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    result = CliRunner().invoke(app, push(run_dir, tiny_llama, "no-org"))
    assert result.exit_code == 1 and result.output.startswith(
        "error: --push-to-hub 'no-org': give the repo as org/name"
    )
    assert len(result.output.strip().splitlines()) == 1  # refused before anything was written
    result = CliRunner().invoke(app, ["export"])
    assert result.exit_code == 1 and result.output.startswith("error: give --out DIR")
