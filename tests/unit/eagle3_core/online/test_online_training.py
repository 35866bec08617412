"""Online training on a tiny target with the transformers engine: the same draft as offline training of the
same samples (same loss, packing, validation, export), no hidden-state set on disk, a cached re-run starts no
engine; and the engine restarted once, a second death failing the phase."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
from safetensors.torch import load_file

from eagle3_core.config import PipelineConfig
from eagle3_core.events import CACHE_HIT, DECISION, WEIGHT_LOAD, RunEvents
from eagle3_core.extraction.phase import extract_hidden_states
from eagle3_core.online.engine import EngineSource
from eagle3_core.online.phase import train_online
from eagle3_core.run_layout import RunLayout
from eagle3_core.serving.engine import EngineDied
from eagle3_core.training.phase import train_draft
from eagle3_core.vocab import build_vocab_map
from tests.helpers.devices import CPU_ONLY
from tests.helpers.extraction_fixtures import build_sample_set


@pytest.fixture(scope="module")
def sample_set(tmp_path_factory, smollm2_target):
    return build_sample_set(tmp_path_factory.mktemp("samples"), smollm2_target.root_path, num_ok=10)


def make_config(run_dir, data: str) -> PipelineConfig:
    config = PipelineConfig(run_dir=run_dir)
    config.sampling.holdout_fraction = 0.0
    config.extraction.backend = "hf"
    config.vocab.draft_vocab_size = 300
    training = config.training
    training.max_steps, training.ttt_steps, training.max_length, training.batch_size = 4, 2, 96, 2
    training.checkpoint_every, training.holdout_fraction, training.device = 2, 0.3, "cpu"
    training.data, training.online_prefetch = data, 2
    return config


def test_online_training_trains_the_offline_draft_without_storing_states(tmp_path, tiny_llama, sample_set) -> None:
    offline = make_config(tmp_path / "offline", "offline")
    events = RunEvents(offline.run_dir)
    hidden = extract_hidden_states(offline, sample_set, tiny_llama, events)
    stored = train_draft(offline, hidden, build_vocab_map(offline, sample_set, tiny_llama, events), tiny_llama, events)

    config = make_config(tmp_path / "online", "online")
    events = RunEvents(config.run_dir)
    vocab_map = build_vocab_map(config, sample_set, tiny_llama, events)
    checkpoint = train_online(config, sample_set, vocab_map, tiny_llama, events, facts=CPU_ONLY)

    assert not RunLayout.of(config).hidden_states.exists()
    assert checkpoint.step == stored.step == 4 and checkpoint.layer_ids == hidden.layer_ids
    for name in ("loss", "val_top1_0", "val_acceptance_length"):
        assert checkpoint.metrics[name] == pytest.approx(stored.metrics[name], rel=1e-4, abs=1e-5), name
    online_weights = load_file(checkpoint.path_of("export") / "model.safetensors")
    offline_weights = load_file(stored.path_of("export") / "model.safetensors")
    # The exported weights agree to a bf16 rounding: the engine prefills each packed item on its own, extraction
    # a shard's samples in padded batches, and bf16 states may differ in their last bit.
    assert all(torch.allclose(online_weights[k], offline_weights[k], rtol=2**-7, atol=2**-7) for k in offline_weights)
    assert checkpoint.upstream["sample_set"] == sample_set.digest and "hidden_states" not in checkpoint.upstream
    lines = [e["message"] for e in events.read() if e["event"] == DECISION and e["phase"] == "training"]
    assert any("share the cores" in line for line in lines)
    assert events.count(WEIGHT_LOAD) == 1  # the engine, started once before training

    again = train_online(config, sample_set, vocab_map, tiny_llama, events, facts=CPU_ONLY)
    assert again.digest == checkpoint.digest and events.count(CACHE_HIT, "training") == 1
    assert events.count(WEIGHT_LOAD) == 1  # a cached draft starts no engine

    config.extraction.dtype = "fp8"  # other states: another draft, trained again
    assert train_online(config, sample_set, vocab_map, tiny_llama, events, facts=CPU_ONLY).digest != again.digest


class DyingEngine:
    """An engine that dies on its first `deaths_left` requests (shared among restarts)."""

    def __init__(self, plan: dict):
        self.plan = plan

    def extract(self, rows):
        if self.plan["deaths_left"]:
            self.plan["deaths_left"] -= 1
            raise EngineDied("extraction engine died mid-shard: exit code -9; log tail: CUDA error")
        return [row["id"] for row in rows], None


def opener(plan: dict):
    @contextmanager
    def opened():
        plan["starts"] += 1
        yield DyingEngine(plan)
        plan["stops"] += 1

    return opened


def test_an_engine_that_dies_is_restarted_once(tmp_path) -> None:
    plan, events = {"deaths_left": 1, "starts": 0, "stops": 0}, RunEvents(tmp_path)
    with EngineSource(opener(plan), events) as source:
        assert source.extract([{"id": "a"}]) == (["a"], None)
    assert plan["starts"] == 2 and plan["stops"] == 2
    [line] = [e["message"] for e in events.read() if e["event"] == DECISION]
    assert line.startswith("the extraction engine died (") and "restarting it once, training waits" in line


def test_a_second_death_fails_with_the_engines_log_tail(tmp_path) -> None:
    plan, events = {"deaths_left": 2, "starts": 0, "stops": 0}, RunEvents(tmp_path)
    with EngineSource(opener(plan), events) as source, pytest.raises(EngineDied, match=r"died again.*log tail: CUDA"):
        source.extract([{"id": "a"}])
    assert plan["starts"] == 2 and plan["stops"] == 2
