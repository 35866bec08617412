"""Synthetic packed training sequences and a tiny objective with its target head, on one CPU process."""

from __future__ import annotations

import torch

from eagle3_core.training.distributed import Group
from eagle3_core.training.loss import TargetHead, TTTObjective
from tests.helpers.drafts import tiny_draft

CPU = Group(rank=0, world=1, device=torch.device("cpu"))


def synthetic_data(count: int, seed: int = 5) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    items = []
    for _ in range(count):
        lengths = [int(n) for n in torch.randint(6, 12, (2,), generator=generator)]
        total = sum(lengths)
        items.append(
            {
                "aux": torch.randn(total, 3, 32, generator=generator),
                "last": torch.randn(total, 32, generator=generator),
                "input_ids": torch.randint(0, 97, (total,), generator=generator),
                "loss_mask": torch.rand(total, generator=generator) > 0.2,
                "position_ids": torch.cat([torch.arange(n) for n in lengths]),
                "document_ids": torch.cat([torch.full((n,), d) for d, n in enumerate(lengths)]),
            }
        )
    return items


def tiny_objective(seed: int = 0) -> tuple[TTTObjective, TargetHead]:
    draft = tiny_draft(seed).float()
    generator = torch.Generator().manual_seed(9)
    head = TargetHead(
        weight=torch.randn(40, 32, generator=generator), norm_weight=torch.ones(32), eps=1e-5, d2t=draft.d2t
    )
    return TTTObjective(draft, ttt_steps=2, step_weight=0.8, attention="eager"), head
