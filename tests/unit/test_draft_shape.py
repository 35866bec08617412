"""The parameter count the training preflight prints is that of the draft training builds: the same shape
function (`draft.shape`) with the recipe flags and `freeze_lm_head` (issue 25: the preflight built its own
draft without them)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from eagle3_core.artifacts import TargetModel
from eagle3_core.config import PipelineConfig
from eagle3_core.events import PREFLIGHT, RunEvents
from eagle3_core.training.phase import build_draft, draft_config_of
from eagle3_core.training.preflight import preflight_training

LAYER_IDS = [2, 4, 5]


@pytest.mark.parametrize(
    "training",
    [{}, {"freeze_lm_head": True}, {"fc_norm": False, "norm_before_fc": True}],
    ids=["default recipe", "frozen lm_head", "input_norm"],
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
