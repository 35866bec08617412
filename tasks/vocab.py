"""Prefect task of the vocab mapping. Keyed on the draft vocabulary size, the held-out split and the
sample set's digest: a new sample set always gets new counts, never a stale map. CPU only: no GPU slot."""

from __future__ import annotations

from prefect import task

from eagle3_core.artifacts import SampleSet, TargetModel, VocabMap
from eagle3_core.config import PipelineConfig
from eagle3_core.events import RunEvents
from eagle3_core.phases import VOCAB
from tasks.policy import PhaseCachePolicy, phase_task_options, run_phase

PHASE = VOCAB.name

POLICY = PhaseCachePolicy(spec=VOCAB)


@task(**phase_task_options(POLICY))
def build_vocab_map_task(config: PipelineConfig, sample_set: SampleSet, target: TargetModel) -> VocabMap:
    from eagle3_core.vocab import build_vocab_map

    return run_phase(PHASE, lambda: build_vocab_map(config, sample_set, target, RunEvents(config.run_dir)))
