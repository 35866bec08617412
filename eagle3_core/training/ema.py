"""The exponential moving average of the draft's trainable weights (`training.ema_decay`): updated after every
optimizer step by torch's EMA rule (`torch.optim.swa_utils.get_ema_multi_avg_fn`, one foreach lerp), put in
place of the raw weights while validation runs and, at the end of training, for good (so the exported draft
is the average). The optimizer only ever sees the raw weights.

Only the trainable parameters are averaged (the frozen target embeddings and the vocabulary buffers never
change), held beside them in their dtype (float32 master weights) on their device. Under DDP every rank
averages the same weights in the same order, so every rank holds the same average, with no communication.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch
from torch import nn
from torch.optim.swa_utils import get_ema_multi_avg_fn


class WeightAverage:
    """EMA of `module`'s trainable parameters, starting at their current values (torch's W_0^EMA = W_0)."""

    def __init__(self, module: nn.Module, decay: float):
        named = [(name, param) for name, param in module.named_parameters() if param.requires_grad]
        self.names = [name for name, _ in named]
        self.params = [param for _, param in named]
        self.average = [param.detach().clone() for param in self.params]
        self._update = get_ema_multi_avg_fn(decay)

    def update(self) -> None:
        """After an optimizer step: average <- decay * average + (1 - decay) * weights."""
        self._update(self.average, [param.detach() for param in self.params], None)

    def apply(self) -> None:
        """Put the average in place of the module's weights, for good."""
        copy_into(self.params, self.average)

    @contextmanager
    def applied(self) -> Iterator[None]:
        """The average in the module's weights inside the block, the raw weights back (bit for bit) after."""
        raw = [param.detach().clone() for param in self.params]
        self.apply()
        try:
            yield
        finally:
            copy_into(self.params, raw)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Parameter name -> its average, on the CPU (what a training state saves)."""
        return {name: average.detach().cpu().clone() for name, average in zip(self.names, self.average, strict=True)}

    def load_state_dict(self, state: dict[str, torch.Tensor] | None) -> None:
        """Restore what `state_dict` returned (a training state's average; None: the state kept none)."""
        if state is None or sorted(state) != sorted(self.names):
            saved = "no EMA" if state is None else f"the EMA of {sorted(state)}"
            raise ValueError(f"the training state holds {saved}; this draft averages {sorted(self.names)}")
        copy_into(self.average, [state[name] for name in self.names])


@torch.no_grad()
def copy_into(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    for target, source in zip(targets, sources, strict=True):
        target.copy_(source)


def weight_average(module: nn.Module, decay: float | None) -> WeightAverage | None:
    """The EMA of `training.ema_decay` (None: none)."""
    return None if decay is None else WeightAverage(module, decay)


def averaged(ema: WeightAverage | None) -> AbstractContextManager[None]:
    """`ema.applied()`, or nothing without an EMA."""
    return nullcontext() if ema is None else ema.applied()
