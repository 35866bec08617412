"""Phase 5 online (`training.data: online`): train the draft on states the target's extraction engine
computes while training runs, asked for a bounded number of samples ahead of the steps that read them
(`hidden_states.online`); no HiddenStateSet is stored and the extraction phase does not run.

The engine is the one offline extraction opens (`extraction.phase.open_backend`: its own vLLM server, the
shared sampling server, or transformers), started before training unless a draft is already trained with
these inputs. Placement (`training.placement`) decides which GPUs (or cores) each side takes. The
checkpoint holds the data position (the step), so a resumed run asks the engine for the states from there on.
Training runs in one process here (the engine, not the draft, is the large part)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from eagle3_core.artifacts import DraftCheckpoint, SampleSet, TargetModel, VocabMap
from eagle3_core.config import PipelineConfig
from eagle3_core.devices import DeviceFacts, host_facts
from eagle3_core.evaluation.speculative import torch_threads
from eagle3_core.events import DECISION, RunEvents
from eagle3_core.extraction.phase import open_backend
from eagle3_core.extraction.phase import phase_config as extraction_config
from eagle3_core.files import sha256_json
from eagle3_core.hidden_states.description import StatesDescription
from eagle3_core.hidden_states.layers import resolve_layer_ids
from eagle3_core.hidden_states.online import OnlineStates
from eagle3_core.online.engine import EngineSource
from eagle3_core.phases import TRAINING
from eagle3_core.progress import ProgressCallback, ignore_progress
from eagle3_core.resolved_run import resolve_run
from eagle3_core.run_layout import RunLayout
from eagle3_core.sampling.table import training_rows
from eagle3_core.training.phase import cached_checkpoint, phase_config, train_draft, upstream_of
from eagle3_core.training.placement import Placement, place_online

GB = 10**9


def online_key(config: PipelineConfig, target: TargetModel) -> str:
    """The digest of what makes the engine's states what they are: extraction's content fields and the layer
    ids as resolved for this target (training's cache key holds it)."""
    return sha256_json(extraction_config(config, target))


def placement_of(config: PipelineConfig, facts: DeviceFacts) -> Placement:
    """`place_online` for this config's server as the resolved run has it on `facts` (a data parallelism left
    to auto is one engine online: the GPUs it would fill offline train)."""
    server = resolve_run(config, facts).config.server
    data_parallel = int(server.data_parallel_size)
    utilization = None if config.server.gpu_memory_utilization == "auto" else server.gpu_memory_utilization
    return place_online(facts, int(server.tensor_parallel_size), data_parallel, utilization)


def placed_config(config: PipelineConfig, placement: Placement) -> PipelineConfig:
    """`config` as `placement` runs it: one training process (on the first training GPU where the GPUs are
    split), the engine on its GPUs (CUDA_VISIBLE_DEVICES) or with its share of the shared GPUs' memory."""
    training = {"processes": 1}
    server: dict[str, Any] = {}
    if placement.mode == "split":
        training["device"] = f"cuda:{placement.training_gpus[0]}"
        server["env"] = {**config.server.env, "CUDA_VISIBLE_DEVICES": ",".join(map(str, placement.engine_gpus))}
        if config.server.data_parallel_size == "auto":
            server["data_parallel_size"] = 1
    elif placement.mode == "shared":
        server["gpu_memory_utilization"] = placement.engine_memory_share
    return config.model_copy(
        update={
            "training": config.training.model_copy(update=training),
            "server": config.server.model_copy(update=server),
        }
    )


@contextmanager
def engine_source(
    config: PipelineConfig,
    target: TargetModel,
    layer_ids: list[int],
    max_tokens: int,
    events: RunEvents,
    progress: ProgressCallback,
    server: Any,
) -> Iterator[EngineSource]:
    """The extraction engine of `config` (or `server`, the shared sampling server) as a StatesSource."""
    with EngineSource(
        lambda: open_backend(config, target, layer_ids, events, progress, server, max_tokens), events
    ) as s:
        yield s


def train_online(
    config: PipelineConfig,
    sample_set: SampleSet,
    vocab_map: VocabMap,
    target: TargetModel,
    events: RunEvents,
    progress: ProgressCallback = ignore_progress,
    server: Any = None,
    facts: DeviceFacts | None = None,
) -> DraftCheckpoint:
    """Train (or resume, or reuse) the draft on the engine's states of the SampleSet's training rows."""
    layer_ids = resolve_layer_ids(config, target)
    rows = training_rows(sample_set, config.sampling.holdout_fraction)
    if not rows:
        raise ValueError(f"{sample_set.root}: no ok, non-held-out samples to train on")
    placement = placement_of(config, facts or host_facts())
    config = placed_config(config, placement)
    events.record(TRAINING.name, DECISION, placement.line(), placement=placement.mode)
    tc = config.training
    description = StatesDescription(tuple(layer_ids), config.extraction.dtype, target.hidden_size)
    max_tokens = max(len(row["input_ids"]) for row in rows)
    with (
        engine_source(config, target, layer_ids, max_tokens, events, progress, server) as source,
        torch_threads(placement.training_threads),
    ):
        states = OnlineStates(
            source,
            rows,
            description,
            sample_set.digest,
            online_key(config, target),
            tc.online_prefetch,
            int(tc.online_cache_gb * GB),
        )
        out_dir = RunLayout.of(config).draft.root
        if cached_checkpoint(out_dir, phase_config(config), upstream_of(states, vocab_map, target)) is None:
            source.start()  # here, not in a fetching thread: see `online.engine`
        return train_draft(config, states, vocab_map, target, events, progress)
