"""The training phase end to end on tiny random targets (Llama, and DeepSeek-V3 with MLA + MoE and a weight
average): hf hidden states -> vocab map -> train_draft -> exported folder; a re-run is a cache hit; stale
vocab refused."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from eagle3_core.config import PipelineConfig
from eagle3_core.draft.export import load_exported
from eagle3_core.draft.model import DraftKVCache
from eagle3_core.evaluation.speculative import propose_chain
from eagle3_core.events import CACHE_HIT, PREFLIGHT, RunEvents
from eagle3_core.extraction.phase import extract_hidden_states
from eagle3_core.training import phase
from eagle3_core.training.phase import build_draft, export_training_state, train_draft
from eagle3_core.vocab import StaleVocabMap, build_vocab_map
from tests.helpers.extraction_fixtures import build_sample_set


@pytest.fixture(scope="module")
def sample_set(tmp_path_factory, smollm2_target):
    return build_sample_set(tmp_path_factory.mktemp("samples"), smollm2_target.root_path, num_ok=10)


def make_config(run_dir) -> PipelineConfig:
    config = PipelineConfig(run_dir=run_dir)
    config.sampling.holdout_fraction = 0.0
    config.extraction.backend = "hf"
    config.vocab.draft_vocab_size = 300
    training = config.training
    training.max_steps, training.ttt_steps, training.max_length = 4, 2, 96
    training.checkpoint_every, training.holdout_fraction, training.device = 2, 0.3, "cpu"
    return config


@pytest.mark.parametrize(("target_name", "ema_decay"), [("tiny_llama", None), ("tiny_deepseek", 0.9)])
def test_train_draft_end_to_end(request, tmp_path, sample_set, target_name, ema_decay) -> None:
    target = request.getfixturevalue(target_name)
    config = make_config(tmp_path)
    config.training.ema_decay = ema_decay  # the export and the final state's re-export are both the average
    events = RunEvents(tmp_path)
    hidden = extract_hidden_states(config, sample_set, target, events)
    vocab_map = build_vocab_map(config, sample_set, target, events)
    checkpoint = train_draft(config, hidden, vocab_map, target, events)

    assert checkpoint.step == 4 and checkpoint.layer_ids == hidden.layer_ids
    assert {"val_top1_0", "val_acceptance_length", "initial_val_top1_0", "loss"} <= set(checkpoint.metrics)
    # The default recipe trains norm_before_residual, which SGLang does not build: the export says so once.
    [warning] = [e for e in events.read() if "SGLang" in e.get("message", "")]
    assert (
        warning["ignored_by_sglang"] == ["norm_before_residual"] and "norm_before_residual=false" in warning["message"]
    )
    export = checkpoint.path_of("export")
    exported_config = json.loads((export / "config.json").read_text())
    assert exported_config["eagle_aux_hidden_state_layer_ids"] == hidden.layer_ids
    assert exported_config["draft_vocab_size"] == 300
    assert exported_config["hidden_size"] == target.hidden_size
    draft = load_exported(export, target.root_path)
    tokens, _ = propose_chain(draft, DraftKVCache(), torch.randn(5, 3, target.hidden_size), torch.arange(5), 3)
    assert bool(draft.t2d[tokens].all())
    assert (checkpoint.root_path / "state" / "step-00000004.pt").exists()
    curves = [checkpoint.root_path / name for name in ("training_curves.png", "curves.jsonl", "tensorboard")]
    assert all(path.exists() for path in curves)  # rank 0's curves, beside the state
    export_training_state(config, hidden, vocab_map, target, tmp_path / "re-export")  # newest state = final
    exported, again = load_file(export / "model.safetensors"), load_file(tmp_path / "re-export" / "model.safetensors")
    assert exported.keys() == again.keys() and all(torch.equal(exported[k], again[k]) for k in exported)

    again = train_draft(config, hidden, vocab_map, target, events)
    assert again.digest == checkpoint.digest and events.count(CACHE_HIT, "training") == 1


def test_a_vocab_map_from_other_samples_is_refused(tmp_path, tiny_llama, sample_set, smollm2_target) -> None:
    config = make_config(tmp_path)
    events = RunEvents(tmp_path)
    hidden = extract_hidden_states(config, sample_set, tiny_llama, events)
    other_samples = build_sample_set(tmp_path / "other", smollm2_target.root_path, num_ok=4)
    other_config = make_config(tmp_path / "other-run")
    stale = build_vocab_map(other_config, other_samples, tiny_llama, events)
    with pytest.raises(StaleVocabMap):
        train_draft(config, hidden, stale, tiny_llama, events)


def test_the_preflight_counts_the_parameters_train_draft_trains(tmp_path, tiny_llama, sample_set, monkeypatch) -> None:
    """With recipe flags and `freeze_lm_head` set, training's preflight line counts the trainable
    parameters of the very draft `train_draft` builds and trains (issue 25)."""
    config = make_config(tmp_path)
    training = config.training
    training.max_steps, training.freeze_lm_head, training.fc_norm, training.norm_before_fc = 2, True, False, True
    built = []

    def spied_build_draft(*args):
        built.append(build_draft(*args))
        return built[-1]

    monkeypatch.setattr(phase, "build_draft", spied_build_draft)
    events = RunEvents(tmp_path)
    hidden = extract_hidden_states(config, sample_set, tiny_llama, events)
    train_draft(config, hidden, build_vocab_map(config, sample_set, tiny_llama, events), tiny_llama, events)
    [draft] = built
    [line] = [e for e in events.read() if e["event"] == PREFLIGHT and e["phase"] == "training"]
    assert line["draft_parameters"] == sum(p.numel() for p in draft.parameters() if p.requires_grad)
    assert not draft.lm_head.weight.requires_grad and draft.config.norm_before_fc and not draft.config.fc_norm


def test_train_draft_trains_against_the_configured_target_temperature(tmp_path, tiny_llama, sample_set, monkeypatch):
    """`training.target_temperature` reaches the objective `train_draft` trains (a field the phase did not pass on
    would only change the cache key)."""
    config = make_config(tmp_path)
    config.training.max_steps, config.training.target_temperature = 1, 0.5
    built, objective_class = [], phase.TTTObjective

    def spied_objective(*args, **kwargs):
        built.append(objective_class(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(phase, "TTTObjective", spied_objective)
    events = RunEvents(tmp_path)
    hidden = extract_hidden_states(config, sample_set, tiny_llama, events)
    train_draft(config, hidden, build_vocab_map(config, sample_set, tiny_llama, events), tiny_llama, events)
    assert [objective.target_temperature for objective in built] == [0.5]


def test_export_engines_naming_sglang_train_only_flags_sglang_builds(tmp_path, tiny_llama, sample_set) -> None:
    """With `export.engines: [vllm, sglang]` the default recipe's norm_before_residual is not trained (SGLang
    would serve another layer), the decision line says what it costs, the setting is in the training key, and the
    export's card says which engines serve it."""
    import yaml

    from eagle3_core.events import DECISION
    from eagle3_core.training.phase import phase_config

    config = make_config(tmp_path)
    both = config.model_copy(deep=True)
    both.export.engines = ["vllm", "sglang"]
    assert phase_config(both) != phase_config(config) and "export" not in phase_config(config)  # default: unkeyed
    events = RunEvents(tmp_path)
    hidden = extract_hidden_states(both, sample_set, tiny_llama, events)
    vocab_map = build_vocab_map(both, sample_set, tiny_llama, events)
    checkpoint = train_draft(both, hidden, vocab_map, tiny_llama, events)

    exported = json.loads((checkpoint.path_of("export") / "config.json").read_text())
    assert not exported["norm_before_residual"] and exported["fc_norm"] and exported["norm_output"]
    [line] = [e for e in events.read() if e["event"] == DECISION and "export.engines" in e["message"]]
    assert line["turned_off"] == ["norm_before_residual"] and "0.13 τ on validation" in line["message"]
    assert not [e for e in events.read() if e.get("ignored_by_sglang")]  # nothing left for SGLang to ignore
    card = (checkpoint.path_of("export") / "README.md").read_text()
    assert yaml.safe_load(card.split("---\n")[1])["library_name"] == "vllm"
    assert "| served by | vLLM, SGLang (export.engines) |" in card and "recipe flags | fc_norm, norm_output |" in card
    assert train_draft(config, hidden, vocab_map, tiny_llama, events).digest != checkpoint.digest  # another key
