"""The keys the core phases compare before reusing what they made (what `eagle3 <command>` decides by), for
the tests that hold them against the Prefect cache keys of the same phases: on a target manifest of
SmolLM2-135M's shape, one HumanEval-like prompt and one conversation of two assistant turns (where
`sampling.turns` changes the rows, so it is in the key)."""

from __future__ import annotations

from typing import Any

from eagle3_core.config import PipelineConfig
from eagle3_core.evaluation.phase import measurement_keys, verdict_fields
from eagle3_core.evaluation.prompts import EvalPrompt
from eagle3_core.extraction.phase import folder_key as extraction_key
from eagle3_core.sampling.prompts import Prompt
from eagle3_core.sampling.store import run_key
from eagle3_core.training.phase import phase_config as training_key
from eagle3_core.vocab import phase_config as vocab_key
from tests.helpers.targets import smollm2_shaped_target

TARGET = smollm2_shaped_target()
PROMPTS = {"humaneval": [EvalPrompt(id="p0", messages=[{"role": "user", "content": "hi"}], prompt_set="humaneval")]}
CONVERSATION = Prompt("c0", [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                             {"role": "user", "content": "and?"}])  # fmt: skip


def core_key(config: PipelineConfig, phase: str) -> Any:
    """What the core phase compares before resuming or reusing its folder."""
    if phase == "sampling":
        return run_key(config, TARGET, [CONVERSATION])
    if phase == "extraction":  # the folder's key; its shard layout is kept by the folder (`shard_size`)
        return extraction_key(config, TARGET)
    if phase == "vocab":
        return vocab_key(config, TARGET)
    if phase == "training":
        return training_key(config)
    if phase == "evaluation":
        return (*measurement_keys(config, {}, PROMPTS), verdict_fields(config))
    return None  # prepare_target keys its converted folder by the GGUF's digest, not by config fields
