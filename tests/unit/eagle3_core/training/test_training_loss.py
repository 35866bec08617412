"""The TTT objective: fused chunked soft cross-entropy equals the plain autograd formula (value and
gradients), the step/target alignment and masks, and the acceptance simulation."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from eagle3_core.training.loss import (
    TargetHead,
    TTTObjective,
    acceptance_counts,
    acceptance_summary,
    decoding_counts,
    fused_soft_cross_entropy_rows,
    step_valid,
)
from tests.helpers.drafts import random_batch, tiny_draft, unroll


def fused_soft_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, target_logits: torch.Tensor, row_weights: torch.Tensor, chunk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`fused_soft_cross_entropy_rows` with target row n = target_logits[n]: (weighted loss sum, argmax)."""
    loss, _, top1 = fused_soft_cross_entropy_rows(hidden, weight, target_logits, row_weights, None, None, chunk)
    return loss, top1


def test_fused_soft_cross_entropy_matches_autograd() -> None:
    torch.manual_seed(0)
    hidden = torch.randn(11, 8, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(13, 8, dtype=torch.float64, requires_grad=True)
    target = torch.randn(11, 13, dtype=torch.float64)
    row_weights = torch.rand(11, dtype=torch.float64)
    loss, top1 = fused_soft_cross_entropy(hidden, weight, target, row_weights, chunk=4)
    (loss * 3).backward()
    fused_grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    logits = hidden @ weight.T
    want = -(row_weights[:, None] * torch.softmax(target, -1) * torch.log_softmax(logits, -1)).sum()
    (want * 3).backward()
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(fused_grads[0], hidden.grad)
    torch.testing.assert_close(fused_grads[1], weight.grad)
    assert torch.equal(top1, logits.argmax(-1))


def test_step_valid_respects_documents_and_loss_mask() -> None:
    loss_mask = torch.tensor([[0, 1, 1, 1, 1, 1, 0, 1, 1]])
    document_ids = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1, 1]])
    # step 0 at i scores token i+2: i=0..2 -> tokens 2..4 (doc 0, masked 1); i=3 -> token 5 (other doc).
    assert step_valid(loss_mask, document_ids, 0).long().tolist() == [[1, 1, 1, 0, 0, 1, 1, 0, 0]]
    assert step_valid(loss_mask, document_ids, 1).long().tolist() == [[1, 1, 0, 0, 0, 1, 0, 0, 0]]
    assert not step_valid(loss_mask, document_ids, 8).any()


def test_acceptance_counts_stop_at_first_miss() -> None:
    agree = torch.tensor([[1, 1, 0, 1], [1, 0, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)[:, None]
    valid = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0], [0, 1, 1, 0]], dtype=torch.bool)[:, None]
    accepted, chains = acceptance_counts(agree, valid)
    assert chains == 3
    assert accepted.tolist() == [2, 1, 0]  # chain 0 stops at position 2 (sample ended)
    tau, per_position = acceptance_summary(accepted, chains)
    assert per_position == [2 / 3, 1 / 3, 0.0] and abs(tau - 2.0) < 1e-9


def chains_of(leading: list[int], starts: list[bool], steps: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """agree/valid [K, 1, T] whose chain at index i accepts exactly leading[i] draft tokens."""
    agree = torch.tensor([[k < n for n in leading] for k in range(steps)])[:, None]
    valid = torch.tensor([starts] * steps)[:, None]
    return agree, valid


def test_decoding_counts_walk_rounds_not_positions() -> None:
    agree, valid = chains_of([3, 2, 0, 3, 1, 0, 0, 2], [True] * 8)
    # The target makes the first token (index 0's chain is never drafted); rounds at 1, 4, 6, 7 accept 2, 1, 0, 2.
    accepted, rounds = decoding_counts(agree, valid)
    assert rounds == 4 and accepted.tolist() == [3, 2, 0]
    assert acceptance_summary(accepted, rounds)[0] == 2.25
    every_position = acceptance_summary(*acceptance_counts(agree, valid))[0]
    assert every_position == 2.375  # the easy stretches counted once per position


def test_decoding_counts_walk_each_response_apart() -> None:
    starts = [True, True, False, False, True, True, True, False]
    agree, valid = chains_of([1, 1, 0, 0, 3, 0, 2, 0], starts)
    # Response 1: a round at 1 accepts 1 and runs past its end; response 2: rounds at 5 (0) and 6 (2).
    accepted, rounds = decoding_counts(agree, valid)
    assert rounds == 3 and accepted.tolist() == [2, 1, 0]


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_objective_scores_each_step_against_the_shifted_target_row(temperature: float) -> None:
    draft = tiny_draft()
    aux, input_ids, position_ids, document_ids = random_batch(draft, [9, 7])
    last = torch.randn(1, 16, 32, dtype=torch.float64)
    loss_mask = torch.ones(1, 16, dtype=torch.bool)
    head = TargetHead(weight=torch.randn(40, 32, dtype=torch.float64), norm_weight=None, eps=1e-5, d2t=draft.d2t)
    batch = {
        "aux": aux,
        "input_ids": input_ids,
        "position_ids": position_ids,
        "document_ids": document_ids,
        "loss_mask": loss_mask,
        "last": last,
    }
    objective = TTTObjective(draft, ttt_steps=3, step_weight=0.5, attention="eager", target_temperature=temperature)
    loss, stats, agree, valid = objective(batch, head)
    loss.backward()
    assert draft.fc.weight.grad is not None and draft.embed_tokens.weight.grad is None
    with torch.no_grad():  # the temperature changes what is learned, never what counts as agreeing
        _, plain_stats, plain_agree, _ = TTTObjective(draft, ttt_steps=3, step_weight=0.5, attention="eager")(
            batch, head
        )
    assert torch.equal(agree, plain_agree) and torch.equal(stats[:, 1:], plain_stats[:, 1:])
    states = unroll(draft, aux, input_ids, position_ids, document_ids, 3)
    target_logits = last @ head.weight.T / temperature
    want = 0.0
    for step in range(3):
        rows = valid[step].nonzero(as_tuple=True)
        logits = draft.compute_logits(states[step][rows])
        ce = -(torch.softmax(target_logits[rows[0], rows[1] + step + 1], -1) * torch.log_softmax(logits, -1)).sum(-1)
        want = want + 0.5**step * ce.mean()
        assert int(stats[step, 2]) == len(rows[0]) == (9 - step - 2) + (7 - step - 2)
    torch.testing.assert_close(loss.double(), want.detach())


TRITON_CHECK = """
import torch
from eagle3_core.training.loss import soft_ce_rows
from eagle3_core.training.soft_ce_triton import soft_ce_rows_triton

torch.manual_seed(0)
for dtype in (torch.float32, torch.bfloat16):
    logits = (torch.randn(6, 300) * 4).to(dtype)
    logits[2, 5] = logits[2, 200] = logits[2].max() + 1  # a tie across blocks: the first index wins
    targets = (torch.randn(9, 300) * 4).to(dtype)
    target_rows = torch.tensor([8, 0, 3, 3, 1, 7])
    weights = torch.rand(6)
    want_grad = logits.clone()
    want_loss, want_top1 = soft_ce_rows(want_grad, targets, target_rows, weights)
    grad = logits.clone()
    loss, top1 = soft_ce_rows_triton(grad, targets, target_rows, weights, block=64)  # 5 blocks, last masked
    assert torch.equal(top1, want_top1), (top1, want_top1)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad.float(), want_grad.float(), rtol=tolerance, atol=tolerance * 1e-2)
print("OK")
"""


def test_triton_soft_ce_kernel_matches_torch_reference() -> None:
    """The GPU kernel's logic, run by Triton's interpreter on the CPU, against `soft_ce_rows`: same CE per
    row, same gradient (written over the logits), same first argmax, over several blocks with a masked tail."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, "-c", TRITON_CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "OK", result.stderr[-3000:]
