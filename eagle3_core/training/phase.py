"""Phase 5, train the draft: wire hidden states (a stored set, or online a live engine's: `hidden_states.online`),
vocab map and target into the loop, then export the vLLM/SGLang-loadable folder to `<run_dir>/draft/export/`
with the resumable state beside it (`<run_dir>/draft/state/`) and the training curves
(`<run_dir>/draft/tensorboard/`, `curves.jsonl`, `training_curves.png`: `curves`). Under torchrun every rank
calls this; rank 0 writes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from eagle3_core.artifacts import DraftCheckpoint, HiddenStateSet, TargetModel, VocabMap, record_files
from eagle3_core.config import PipelineConfig
from eagle3_core.draft.export import export_draft, load_exported, sglang_ignores
from eagle3_core.draft.model import DraftConfig, Eagle3Draft
from eagle3_core.draft.shape import trained_draft_config, turned_off_for_sglang
from eagle3_core.events import CACHE_HIT, DECISION, RunEvents
from eagle3_core.files import folder_identity, remove_dead_temps, sha256_json, write_text_atomic
from eagle3_core.hidden_states.description import StatesDescription
from eagle3_core.hidden_states.online import OnlineDataset, OnlineStates
from eagle3_core.hidden_states.reader import HiddenStateDataset
from eagle3_core.kept import switch_key
from eagle3_core.phases import TRAINING, phase_key
from eagle3_core.progress import ProgressCallback, ignore_progress
from eagle3_core.release.card import write_model_card
from eagle3_core.run_layout import RunLayout
from eagle3_core.training.curves import TrainingCurves
from eagle3_core.training.distributed import Group, barrier, process_group
from eagle3_core.training.loop import PHASE, run_training, split_validation
from eagle3_core.training.loss import TargetHead, TTTObjective
from eagle3_core.training.preflight import preflight_training
from eagle3_core.training.state import FULL
from eagle3_core.vocab import load_vocab_tensors

KEY_FILE = "key.json"
# What training reads: a stored HiddenStateSet (`training.data: offline`), or a live engine's states (online).
TrainingStates = HiddenStateSet | OnlineStates


def phase_config(config: PipelineConfig, world: int = 1) -> dict:
    """The training fields marked content (not where it runs, how it is sharded, how often it saves or
    whether it is compiled), the files of the warm-start checkpoint, if any, and the processes that train
    (`world`: `training.batch_size` is per process, so their number makes the global batch and the schedule;
    left out for one, the key of every run before it was keyed)."""
    cfg = {**phase_key(config, TRAINING), "warm_start": folder_identity(config.training.warm_start)}
    return cfg if world == 1 else {**cfg, "world": world}


def rank_world() -> int:
    """The processes training together, as torchrun tells each of them (1 outside torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def upstream_of(states: TrainingStates, vocab_map: VocabMap, target: TargetModel) -> dict[str, str]:
    """The inputs' digests a checkpoint records (and is reused for): a stored set's, or online the SampleSet's
    and the key of the states the engine gives (extraction's content fields)."""
    if isinstance(states, OnlineStates):
        return online_upstream(states.sample_set, states.key, vocab_map, target)
    return {"hidden_states": states.digest, "vocab_map": vocab_map.digest, "target": target.digest}


def online_upstream(sample_set: str, key: str, vocab_map: VocabMap, target: TargetModel) -> dict[str, str]:
    """`upstream_of` online states: the SampleSet's digest and `key`, the digest of extraction's content fields."""
    return {"sample_set": sample_set, "online_states": key, "vocab_map": vocab_map.digest, "target": target.digest}


def described(states: TrainingStates) -> StatesDescription:
    """What the states are (layer ids, dtype, hidden size, last-state-normed), stored or online."""
    return states.description if isinstance(states, OnlineStates) else StatesDescription.of_set(states)


def sample_set_of(states: TrainingStates) -> str:
    """The digest of the SampleSet the states are of (the vocab map must be counted on it)."""
    return states.sample_set if isinstance(states, OnlineStates) else states.upstream.get("sample_set", "")


def dataset_of(
    states: TrainingStates, max_length: int, sample_ids: list[str] | None = None
) -> HiddenStateDataset | OnlineDataset:
    """Packed sequences of the states (`sample_ids`: those only, in that order), as stored (bf16 / fp8): the
    loop copies them to its device and dequantises them there."""
    if isinstance(states, OnlineStates):
        return OnlineDataset(states, max_length, sample_ids)
    return HiddenStateDataset(states, max_length, sample_ids, dequantize=False)


def target_rms_eps(target: TargetModel) -> float:
    """The target's final-norm epsilon (1e-6 where its config names none)."""
    eps = target.recorded_text.rms_norm_eps
    return 1e-6 if eps is None else eps


def cached_checkpoint(out_dir: Path, cfg: dict, upstream: dict) -> DraftCheckpoint | None:
    stored = DraftCheckpoint.load_valid(out_dir)
    return stored if stored is not None and stored.config == cfg and stored.upstream == upstream else None


def reused_checkpoint(out_dir: Path, cfg: dict, upstream: dict, events: RunEvents) -> DraftCheckpoint | None:
    """`cached_checkpoint`, with its cache hit recorded."""
    cached = cached_checkpoint(out_dir, cfg, upstream)
    if cached is not None:
        events.record(PHASE, CACHE_HIT, f"draft at {out_dir} is trained and valid", digest=cached.digest)
    return cached


def stored_key(key_path: Path) -> dict | None:
    """The key file of a state folder ({"key", and since they were recorded "config", "upstream"}), else None."""
    try:
        stored = json.loads(key_path.read_text())
    except (OSError, ValueError):
        return None
    return stored if isinstance(stored, dict) and isinstance(stored.get("key"), str) else None


def prepare_state_dir(state_dir: Path, key: dict, events: RunEvents, group: Group, kept_root: Path) -> None:
    """Resume only a state made with this key (`key`: its "key" digest, its "config" and "upstream"). The states
    of another key are set aside under `kept_root/<key id>` (`eagle3_core.kept`), not removed, and those of this
    key come back from there; temporary files of a killed writer are removed."""
    if group.is_main:
        key_path = state_dir / KEY_FILE
        stored = stored_key(key_path)
        for line in switch_key(state_dir, kept_root, KEY_FILE, stored, key, state_key_id, "training state"):
            events.record(PHASE, DECISION, line)
        state_dir.mkdir(parents=True, exist_ok=True)
        remove_dead_temps(state_dir)
        write_text_atomic(key_path, json.dumps(key))
    barrier(group)


def state_key_id(key: dict) -> str:
    """The kept folder name of a state key: its digest's first 16 hex digits."""
    return key["key"][:16]


VOCAB_TENSORS = ("lm_head.weight", "d2t", "t2d", "embed_tokens.weight")


def warm_start(draft: Eagle3Draft, previous: Eagle3Draft, source: str) -> None:
    """Copy a previous drafter's trained layers into `draft`, which already carries this run's vocabulary.

    A nightly run may have a new draft vocabulary (new samples, new counts): `lm_head` rows are matched by
    TARGET token id, so a token kept in the vocabulary keeps its trained row and a new token keeps the
    target's row that `from_target` gave it; `d2t`/`t2d` stay this run's.
    """
    own, old = draft.state_dict(), previous.state_dict()
    for name, tensor in old.items():
        if name in VOCAB_TENSORS:
            continue
        if name not in own or own[name].shape != tensor.shape:
            raise ValueError(f"warm start {source}: tensor {name} {tuple(tensor.shape)} does not fit this draft")
        own[name].copy_(tensor)
    old_rows = {int(t): i for i, t in enumerate(previous.draft_to_target(torch.arange(len(previous.d2t))))}
    new_targets = draft.draft_to_target(torch.arange(len(draft.d2t)))  # [draft_vocab] target ids
    kept = [(j, old_rows[int(t)]) for j, t in enumerate(new_targets) if int(t) in old_rows]
    if kept:
        new_idx, old_idx = (torch.tensor(ix) for ix in zip(*kept, strict=True))
        with torch.no_grad():
            draft.lm_head.weight[new_idx] = previous.lm_head.weight[old_idx].to(draft.lm_head.weight.dtype)


def draft_config_of(
    config: PipelineConfig, target: TargetModel, vocab_map: VocabMap, layer_ids: list[int]
) -> DraftConfig:
    """The draft's shape (`draft.shape`, the one its preflight counts) from the target's manifest, its recipe
    flags those the engines of `export.engines` serve."""
    return trained_draft_config(config.training, target, vocab_map.draft_vocab_size, layer_ids, config.export.engines)


def build_draft(config: PipelineConfig, target: TargetModel, draft_config: DraftConfig, d2t, t2d) -> Eagle3Draft:
    torch.manual_seed(config.training.seed)
    draft = Eagle3Draft.from_target(draft_config, target.root_path, t2d, d2t)
    if config.training.warm_start:
        previous = load_exported(config.training.warm_start, target.root_path)
        warm_start(draft, previous, config.training.warm_start)
    if config.training.freeze_lm_head:  # stays the target's rows (or the warm start's)
        draft.lm_head.weight.requires_grad_(False)
    return draft


def train_draft(
    config: PipelineConfig,
    hidden_states: TrainingStates,
    vocab_map: VocabMap,
    target: TargetModel,
    events: RunEvents,
    progress: ProgressCallback = ignore_progress,
) -> DraftCheckpoint:
    """Train (or resume, or reuse) the draft and return its checkpoint manifest."""
    cfg, upstream = phase_config(config, rank_world()), upstream_of(hidden_states, vocab_map, target)
    if (cached := reused_checkpoint(RunLayout.of(config).draft.root, cfg, upstream, events)) is not None:
        return cached
    with process_group(config.training.device) as group:  # left once the draft and its optimizer are freed
        return train_ranks(config, hidden_states, vocab_map, target, events, progress, group, cfg, upstream)


def train_ranks(
    config: PipelineConfig,
    hidden_states: TrainingStates,
    vocab_map: VocabMap,
    target: TargetModel,
    events: RunEvents,
    progress: ProgressCallback,
    group: Group,
    cfg: dict,
    upstream: dict[str, str],
) -> DraftCheckpoint:
    """This rank's part of training: every rank trains, rank 0 exports and writes the manifest. `cfg` and
    `upstream`: `phase_config` and `upstream_of`, as `train_draft` checked the cache with them."""
    tc = config.training
    draft_dir = RunLayout.of(config).draft
    out_dir = draft_dir.root
    recorder = events if group.is_main else None  # every rank checks, one line is logged
    description = described(hidden_states)
    preflight_training(config, description, target, vocab_map.draft_vocab_size, out_dir, recorder)
    d2t, t2d = load_vocab_tensors(vocab_map, sample_set_of(hidden_states))
    draft_config = draft_config_of(config, target, vocab_map, list(description.layer_ids))
    if group.is_main and (off := turned_off_for_sglang(tc, config.export.engines)):
        events.record(PHASE, DECISION, sglang_recipe_line(off), turned_off=off, engines=config.export.engines)
    draft = build_draft(config, target, draft_config, d2t, t2d)
    head = TargetHead.from_target(target.root_path, t2d, d2t, description.last_state_normed, target_rms_eps(target))
    everything = dataset_of(hidden_states, tc.max_length)
    train_ids, val_ids = split_validation(everything.sample_ids, tc.holdout_fraction, everything.prompt_ids)
    train_data = dataset_of(hidden_states, tc.max_length, train_ids)
    val_data = dataset_of(hidden_states, tc.max_length, val_ids) if val_ids else None
    if group.is_main:
        events.record(
            PHASE,
            DECISION,
            f"training on {len(train_ids)} samples ({len(train_data)} packed sequences), validating on "
            f"{len(val_ids)}; {train_data.truncated} samples truncated to {tc.max_length} tokens"
            + (f"; states asked of the engine {tc.online_prefetch} samples ahead" if tc.data == "online" else ""),
            world=group.world,
            device=str(group.device),
        )
    state_dir = draft_dir.state
    state_key = {"key": sha256_json({"config": cfg, "upstream": upstream}), "config": cfg, "upstream": upstream}
    prepare_state_dir(state_dir, state_key, events, group, RunLayout.of(config).kept(state_dir))
    objective = TTTObjective(
        draft, tc.ttt_steps, tc.step_weight, tc.attention, tc.mask_out_of_vocab, tc.target_temperature
    )
    curves = TrainingCurves(out_dir if group.is_main else None)  # draft/tensorboard/, draft/training_curves.png
    step, metrics = run_training(
        objective, head, train_data, val_data, tc, state_dir, group, events, progress, curves=curves
    )
    full_state = get_model_state_dict(objective, options=FULL)
    checkpoint = None
    if group.is_main:
        exported = Eagle3Draft(draft_config)
        exported.load_state_dict({k.removeprefix("draft."): v for k, v in full_state.items()}, strict=True)
        paths = export_draft(exported, draft_dir.export)
        checkpoint = DraftCheckpoint(
            root=str(out_dir.resolve()),
            files=record_files(out_dir, paths),
            config=cfg,
            upstream=upstream,
            step=step,
            layer_ids=list(description.layer_ids),
            metrics=metrics,
        )
        checkpoint.save()
        write_model_card(config, target, checkpoint, draft_dir.export)
        summary = ", ".join(f"{k} {v:.3f}" for k, v in metrics.items() if k.startswith(("val_top1", "val_accept")))
        events.record(PHASE, DECISION, f"trained {step} steps; {summary}", digest=checkpoint.digest)
        if ignored := sglang_ignores(draft_config):
            events.record(PHASE, DECISION, sglang_warning(ignored), ignored_by_sglang=ignored)
    barrier(group)
    return checkpoint or DraftCheckpoint.load(out_dir)


def sglang_warning(ignored: list[str]) -> str:
    """The export's one line for a draft SGLang would serve as another layer than the one trained."""
    flags = " and ".join(f"training.{flag}" for flag in ignored)
    return (
        f"exported for vLLM: SGLang 0.5.14 does not read {flags} and would serve another layer than the one "
        "trained (lower acceptance, no error); for SGLang train with export.engines: [vllm, sglang] "
        f"({' and '.join(f'{f}=false' for f in ignored)})"
    )


# Per flag SGLang does not read: the releases that do not read it (checked in their wheels' llama_eagle3.py) and
# what training without it costs. norm_before_residual off lost 0.13 tokens a step on validation (SmolLM2, H200,
# 4 epochs, bench/RESULTS.md issue 28); norm_before_fc is off by default and was not measured alone.
SGLANG_FLAGS = {
    "norm_before_residual": ("SGLang 0.5.14 to 0.5.23 (every release checked)", "0.13 τ on validation (H200)"),
    "norm_before_fc": ("SGLang before 0.5.17", "not measured alone"),
}


def sglang_recipe_line(off: list[str]) -> str:
    """The decision line of a recipe trained without the flags SGLang does not read."""
    reasons = "; ".join(f"{flag}: not read by {SGLANG_FLAGS[flag][0]}, cost {SGLANG_FLAGS[flag][1]}" for flag in off)
    return (
        f"export.engines names sglang: training with {', '.join(f'training.{flag}' for flag in off)} off, so vLLM "
        f"and SGLang both serve the layer trained ({reasons})"
    )


def export_training_state(
    config: PipelineConfig,
    hidden_states: HiddenStateSet,
    vocab_map: VocabMap,
    target: TargetModel,
    out_dir: Path,
    state_file: Path | None = None,
) -> list[Path]:
    """Export a resumable training state (default: the newest) as a vLLM/SGLang folder, e.g. to serve an
    intermediate step while training goes on: its weight average where it keeps one (`training.ema_decay`),
    as the phase's own export."""
    from eagle3_core.training.state import latest_state, read_state_file

    state_dir = RunLayout.of(config).draft.state
    state_file = state_file or latest_state(state_dir)
    if state_file is None:
        raise FileNotFoundError(f"no training state under {state_dir}")
    draft = Eagle3Draft(draft_config_of(config, target, vocab_map, hidden_states.layer_ids))
    state = read_state_file(state_file, f"pass another --state (training keeps its newest states in {state_dir})")
    model = {**state["model"], **(state.get("ema") or {})}  # the averaged trainable weights over the raw ones
    missing, unexpected = draft.load_state_dict({k.removeprefix("draft."): v for k, v in model.items()}, strict=False)
    if missing != ["embed_tokens.weight"] or unexpected:
        raise ValueError(f"{state_file}: not a state of this draft (missing {missing}, unexpected {unexpected})")
    return export_draft(draft, out_dir)
