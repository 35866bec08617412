"""The shape of the draft a training run trains, built by one function for training and for its preflight
(so the parameter count and memory estimate the preflight prints are those of the draft that is trained)."""

from __future__ import annotations

from dataclasses import replace

from eagle3_core.artifacts import TargetModel
from eagle3_core.config import SGLANG_IGNORED_FLAGS, TrainingConfig
from eagle3_core.draft.export import RECIPE_FLAGS
from eagle3_core.draft.model import DraftConfig, Eagle3Draft


def served_recipe(training: TrainingConfig, engines: list[str]) -> dict[str, bool]:
    """The recipe flags trained for the engines the draft is exported to (`export.engines`): `training`'s, with
    the flags SGLang does not read (`SGLANG_IGNORED_FLAGS`) off where sglang is one of them."""
    flags = {flag: getattr(training, flag) for flag in RECIPE_FLAGS}
    if "sglang" in engines:
        flags.update(dict.fromkeys(SGLANG_IGNORED_FLAGS, False))
    return flags


def turned_off_for_sglang(training: TrainingConfig, engines: list[str]) -> list[str]:
    """The flags `training` asks for that `served_recipe` turns off for SGLang."""
    return [flag for flag, value in served_recipe(training, engines).items() if getattr(training, flag) != value]


def trained_draft_config(
    training: TrainingConfig,
    target: TargetModel,
    draft_vocab_size: int,
    layer_ids: list[int],
    engines: list[str] | tuple[str, ...] = ("vllm",),
) -> DraftConfig:
    """The draft's shape from the target's text config (as its manifest recorded it), with the architecture,
    MLP width and recipe flags of `training` as served in `engines` (`served_recipe`). ValueError where the
    architecture does not fit the target (an MLA draft, no MLA target)."""
    text = target.text_config
    shape = DraftConfig.from_target_config(text, draft_vocab_size, layer_ids, training.draft_architecture)
    width = training.draft_intermediate_size or shape.intermediate_size
    return replace(shape, intermediate_size=width, **served_recipe(training, list(engines)))


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
