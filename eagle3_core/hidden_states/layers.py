"""Which target layers the states come from: what extraction, its backends and training agree on, below
all of them."""

from __future__ import annotations

from eagle3_core.artifacts import TargetModel
from eagle3_core.config import ConfigError, PipelineConfig
from eagle3_core.target.models import check_layer_ids, default_aux_layer_ids


def resolve_layer_ids(config: PipelineConfig, target: TargetModel) -> list[int]:
    """The configured aux layer ids, or the default for the target's depth; ids that do not fit the target
    (or a target too shallow for the default) fail here, before any weight load, naming the field."""
    try:
        layer_ids = list(config.extraction.layer_ids or default_aux_layer_ids(target.num_layers))
        check_layer_ids(layer_ids, target.num_layers)
    except ValueError as exc:
        raise ConfigError(f"extraction.layer_ids: {exc}") from None
    return layer_ids
