"""What training needs to know of its input states, apart from the files that hold them (if any): the aux
layer ids (vLLM's convention), the dtype they come in, the hidden size and whether the last state is after
the target's final norm. A stored HiddenStateSet carries one; online training builds one from the config
and the target, with no manifest of shards."""

from __future__ import annotations

from dataclasses import dataclass

from eagle3_core.artifacts import HiddenStateSet
from eagle3_core.hidden_states.storage import LAST_STATE_NORMED


@dataclass(frozen=True)
class StatesDescription:
    """The shape and meaning of a sample's states: `aux` [T, len(layer_ids), hidden_size] and `last`
    [T, hidden_size], stored as `dtype` (bf16 or fp8)."""

    layer_ids: tuple[int, ...]
    dtype: str
    hidden_size: int
    last_state_normed: bool = LAST_STATE_NORMED

    @classmethod
    def of_set(cls, hidden_states: HiddenStateSet) -> StatesDescription:
        """The description a stored set's manifest records."""
        return cls(
            tuple(hidden_states.layer_ids),
            hidden_states.dtype,
            hidden_states.hidden_size,
            hidden_states.last_state_normed,
        )
