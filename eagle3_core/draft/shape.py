"""The shape of the draft a training run trains, built by one function for training and for its preflight
(so the parameter count and memory estimate the preflight prints are those of the draft that is trained)."""

from __future__ import annotations

from dataclasses import replace

from eagle3_core.artifacts import TargetModel
from eagle3_core.config import TrainingConfig
from eagle3_core.draft.export import RECIPE_FLAGS
from eagle3_core.draft.model import DraftConfig, Eagle3Draft


def trained_draft_config(
    training: TrainingConfig, target: TargetModel, draft_vocab_size: int, layer_ids: list[int]
) -> DraftConfig:
    """The draft's shape from the target's text config (as its manifest recorded it), with the architecture,
    MLP width and recipe flags of `training`. ValueError where the architecture does not fit the target (an
    MLA draft, no MLA target)."""
    text = target.text_config
    shape = DraftConfig.from_target_config(text, draft_vocab_size, layer_ids, training.draft_architecture)
    width = training.draft_intermediate_size or shape.intermediate_size
    return replace(shape, intermediate_size=width, **{flag: getattr(training, flag) for flag in RECIPE_FLAGS})


def parameter_counts(config: DraftConfig, freeze_lm_head: bool) -> tuple[int, int]:
    """(trainable, frozen) parameters of a draft of this shape, counted on the meta device (no memory):
    the embedding is always frozen, lm_head too with `freeze_lm_head`."""
    import torch

    with torch.device("meta"):
        draft = Eagle3Draft(config)
    if freeze_lm_head:
        draft.lm_head.weight.requires_grad_(False)
    trainable = sum(p.numel() for p in draft.parameters() if p.requires_grad)
    return trainable, sum(p.numel() for p in draft.parameters()) - trainable
