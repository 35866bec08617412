"""The batches a training step reads: every rank runs the same steps over a seeded order, the loader's
scored rows equal the objective's own, prefetched batches equal inline ones from any start, and the loss on
prompt tokens is scored in training batches only."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from eagle3_core.config import TrainingConfig
from eagle3_core.training.batches import BatchPrefetcher, collate, collate_host, rank_batches, step_batches
from eagle3_core.training.distributed import Group
from tests.helpers.training_data import CPU, synthetic_data, tiny_objective


def test_every_rank_runs_the_same_steps_and_an_epoch_covers_every_item() -> None:
    two = [Group(rank=r, world=2, device=torch.device("cpu")) for r in (0, 1)]
    batches = [rank_batches(5, 2, g, seed=0, epoch=3) for g in two]
    assert len(batches[0]) == len(batches[1]) == 2  # padded so both ranks run the same number of steps
    assert sorted({i for batch in batches[0] + batches[1] for i in batch}) == [0, 1, 2, 3, 4]
    assert rank_batches(5, 2, two[0], seed=0, epoch=3) == batches[0]  # deterministic per epoch


def test_scored_rows_from_the_loader_equal_the_objective_own() -> None:
    """`collate(..., ttt_steps)` computes the scored rows on the CPU (no host sync in the step): same loss,
    stats and gradients as the objective computing them itself; a batch scored for other steps is refused."""
    objective, head = tiny_objective()
    items = synthetic_data(2)
    results = []
    for batch in (collate(items, CPU.device, 1), collate(items, CPU.device, 1, objective.ttt_steps)):
        objective.zero_grad(set_to_none=True)
        loss, stats, agree, valid = objective(batch, head)
        loss.backward()
        grads = [p.grad.clone() for p in objective.parameters() if p.requires_grad]
        results.append([loss.detach(), stats, agree, valid, *grads])
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))
    objective.ttt_steps = 3
    with pytest.raises(ValueError, match="TTT steps"):
        objective(collate(items, CPU.device, 1, 2), head)


def inline_batches(data, tc: TrainingConfig, group: Group, start: int, stop: int, pad: int, steps: int) -> list:
    """The loop's batches as it made them before the prefetcher: inline, one step at a time."""
    steps_per_epoch = len(rank_batches(len(data), tc.batch_size, group, tc.seed, 0))
    order_epoch, batches, out = None, [], []
    for step in range(start, stop):
        epoch, index = divmod(step, steps_per_epoch)
        if order_epoch != epoch:
            order_epoch, batches = epoch, rank_batches(len(data), tc.batch_size, group, tc.seed, epoch)
        out.append(collate([data[i] for i in batches[index]], group.device, pad, steps))
    return out


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_prefetched_batches_equal_the_inline_ones_from_any_start(tmp_path: Path, dtype: str) -> None:
    """Same batches, same order, same values (fp8/bf16 states dequantised after the copy instead of when
    read), from step 0 and from a resume position mid-epoch."""
    from eagle3_core.hidden_states.reader import HiddenStateDataset
    from tests.helpers.hidden_state_sets import make_set

    hidden = make_set(tmp_path, [5, 9, 3, 7, 4, 6, 8], dtype=dtype)
    before = HiddenStateDataset(hidden, 12)  # float32 items, as the loop read them before
    stored = HiddenStateDataset(hidden, 12, dequantize=False)
    assert stored[0]["aux"].dtype == (torch.bfloat16 if dtype == "bf16" else torch.float8_e4m3fn)
    tc = TrainingConfig(batch_size=2, seed=3)
    steps_per_epoch = len(rank_batches(len(stored), tc.batch_size, CPU, tc.seed, 0))
    for start in (0, steps_per_epoch + 1):  # from the beginning; resumed mid-way through epoch 1
        stop = start + 2 * steps_per_epoch
        expected = inline_batches(before, tc, CPU, start, stop, 4, 2)
        plan = step_batches(len(stored), tc.batch_size, CPU, tc.seed, steps_per_epoch, start, stop)
        with BatchPrefetcher(stored, plan, CPU.device, 4, 2) as prefetcher:
            got = [prefetcher.next() for _ in range(stop - start)]
        for a, b in zip(expected, got, strict=True):
            assert a.keys() == b.keys()
            assert all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def test_loss_on_prompt_scores_prompt_tokens_in_training_batches_only() -> None:
    """Training batches score every real token (prompt ones too), padding never; validation's `collate`
    scores the assistant tokens as before."""
    items = synthetic_data(2)
    assistant, everything = (collate_host(items, 8, 2, loss_on_prompt=flag)["valid"] for flag in (False, True))
    assert bool((assistant <= everything).all()) and int(everything.sum()) > int(assistant.sum())
    batch = collate_host(items, 8, 2)
    ids = batch["document_ids"]  # [B, T]
    prompt, padding = ~batch["loss_mask"] & (ids >= 0), ids < 0
    within = ids[:, 2:] == ids[:, :-2]  # step 0 at i predicts token i+2 of the same document
    predicts_prompt = prompt[:, 2:] & within
    assert bool(predicts_prompt.any()) and bool(everything[0, :, :-2][predicts_prompt].all())
    assert not bool(everything[0, :, :-2][padding[:, 2:]].any()) and bool(padding.any())
    assert torch.equal(collate(items, CPU.device, 8, 2)["valid"], assistant)
