"""The training task alone in a real Prefect flow run (its cache policy, `gpu` slot, retries and progress), on
upstream manifests already made: what `tests/integration/test_training_torchrun.py` runs in its own process,
and, as a script (`python training_flow.py CONFIG HIDDEN_STATES VOCAB`), the flow process it SIGKILLs."""

from __future__ import annotations

import sys

from prefect import flow

from eagle3_core.artifacts import DraftCheckpoint, HiddenStateSet, TargetModel, VocabMap
from eagle3_core.config import PipelineConfig, load_config
from eagle3_core.events import RunEvents
from eagle3_core.target.prepare import prepare_target
from flows.train_drafter import PhaseRunner
from tasks.training import train_draft_task


@flow(name="train-only")
def train_only(
    config: PipelineConfig, hidden_states: HiddenStateSet, vocab_map: VocabMap, target: TargetModel
) -> DraftCheckpoint:
    return PhaseRunner(config)(train_draft_task, "training", hidden_states, vocab_map, target)


if __name__ == "__main__":
    config = load_config(sys.argv[1])
    target = prepare_target(config.target, RunEvents(config.run_dir))
    train_only(config, HiddenStateSet.load(sys.argv[2]), VocabMap.load(sys.argv[3]), target)
