"""The parameter count the training preflight prints is that of the draft training builds: the same shape
function (`draft.shape`) with the recipe flags and `freeze_lm_head` (issue 25: the preflight built its own
draft without them), from the text config the target's manifest recorded (config.json is read once)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from eagle3_core.artifacts import ArtifactInvalid, TargetModel
from eagle3_core.config import PipelineConfig
from eagle3_core.draft.export import export_draft
from eagle3_core.draft.model import DraftConfig
from eagle3_core.events import PREFLIGHT, RunEvents
from eagle3_core.training.phase import build_draft, draft_config_of
from eagle3_core.training.preflight import preflight_training

LAYER_IDS = [2, 4, 5]


@pytest.mark.parametrize(
    "training",
    [{}, {"freeze_lm_head": True}, {"fc_norm": False, "norm_before_fc": True}, {"draft_intermediate_size": 200}],
    ids=["default recipe", "frozen lm_head", "input_norm", "wider MLP"],
)
def test_training_preflight_counts_the_trained_drafts_parameters(tmp_path: Path, tiny_llama: TargetModel, training):
    config = PipelineConfig(run_dir=tmp_path, training=training)
    draft_vocab = min(64, tiny_llama.vocab_size)
    t2d = torch.zeros(tiny_llama.vocab_size, dtype=torch.bool)
    t2d[:draft_vocab] = True
    shape = draft_config_of(config, tiny_llama, SimpleNamespace(draft_vocab_size=draft_vocab), LAYER_IDS)
    draft = build_draft(config, tiny_llama, shape, torch.zeros(draft_vocab, dtype=torch.long), t2d)
    trained = sum(p.numel() for p in draft.parameters() if p.requires_grad)
    events = RunEvents(tmp_path)
    preflight_training(config, SimpleNamespace(layer_ids=LAYER_IDS), tiny_llama, draft_vocab, tmp_path, events)
    [line] = [e for e in events.read() if e["event"] == PREFLIGHT]
    assert line["draft_parameters"] == trained


@pytest.mark.parametrize("width", [None, 200])
def test_the_draft_mlp_is_as_wide_as_configured_in_training_and_in_the_export(tmp_path, tiny_llama, width) -> None:
    """`training.draft_intermediate_size` widens the draft's MLP (None: the target's): training builds that
    width, and config.json states it beside weights of that shape, which is what vLLM and SGLang allocate."""
    config = PipelineConfig(run_dir=tmp_path, training={"draft_intermediate_size": width})
    shape = draft_config_of(config, tiny_llama, SimpleNamespace(draft_vocab_size=64), LAYER_IDS)
    t2d = torch.zeros(tiny_llama.vocab_size, dtype=torch.bool)
    t2d[:64] = True
    draft = build_draft(config, tiny_llama, shape, torch.zeros(64, dtype=torch.long), t2d)
    expected = width or tiny_llama.text_config["intermediate_size"]
    assert draft.midlayer.mlp.gate_proj.weight.shape == (expected, shape.hidden_size)
    export_draft(draft, tmp_path / "export")
    assert json.loads((tmp_path / "export" / "config.json").read_text())["intermediate_size"] == expected
    weights = load_file(tmp_path / "export" / "model.safetensors")
    assert weights["midlayer.mlp.down_proj.weight"].shape == (shape.hidden_size, expected)


@pytest.mark.parametrize(
    ("fixture", "architecture"),
    [("tiny_llama", "llama"), ("tiny_deepseek", "llama"), ("tiny_deepseek", "deepseek_mla")],
)
def test_the_manifest_records_the_config_the_draft_shape_reads(request, fixture: str, architecture: str) -> None:
    """config.json is read once, when the manifest is made: the shape from the manifest's text config (MLA
    ranks, rms_norm_eps, rope) is the one config.json itself gives."""
    target: TargetModel = request.getfixturevalue(fixture)
    on_disk = json.loads((target.root_path / "config.json").read_text())
    recorded = DraftConfig.from_target_config(target.text_config, 64, LAYER_IDS, architecture)
    assert recorded == DraftConfig.from_target_config(on_disk, 64, LAYER_IDS, architecture)
    assert target.recorded_text.rms_norm_eps == on_disk.get("text_config", on_disk)["rms_norm_eps"]


def test_a_manifest_written_before_the_text_config_loads_with_its_digest(tiny_llama: TargetModel) -> None:
    """An older manifest (no `text`) still loads, with the digest its run folders recorded; what would read
    the text config names the way out."""
    older = json.loads(tiny_llama.model_dump_json(exclude={"text", "digest"}))
    loaded = TargetModel.from_json(json.dumps(older))
    assert loaded.text is None and loaded.digest == tiny_llama.digest
    with pytest.raises(ArtifactInvalid, match="prepare the target again"):
        draft_config_of(PipelineConfig(), loaded, SimpleNamespace(draft_vocab_size=64), LAYER_IDS)
