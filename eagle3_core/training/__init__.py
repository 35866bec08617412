"""Draft training: train-time-test attention (`attention`), the loss (`loss`), the training loop and its
resumable state (`loop`), torchrun process groups (`distributed`) and the flow's launch of torchrun over
`training.processes` processes (`launch`).

`train_draft` imports the loop on first call: the model, attention and loss import only torch, so the GPU
benchmark can use them on a machine without pydantic."""

from __future__ import annotations

from typing import Any


def train_draft(*args: Any, **kwargs: Any) -> Any:
    """`eagle3_core.training.phase.train_draft` (see there)."""
    from eagle3_core.training.phase import train_draft as run

    return run(*args, **kwargs)
