"""Deferred weight gradients are kept per unroll: a second draft's whole backward run in the middle of the
first one's (from a hook, as a reentrant backward or another device's autograd thread would) leaves both
with their own steps' sums (issue 25: one process-wide dict keyed by the matrix name alone mixed them)."""

from __future__ import annotations

import torch

from tests.helpers.drafts import random_batch, tiny_draft, unroll


def loss_of(draft, batch, defer: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    states = unroll(draft, *batch, ttt_steps=3, defer=defer)
    return sum((draft.compute_logits(s).logsumexp(-1) * (k + 1)).sum() for k, s in enumerate(states)), states


def gradients(drafts, batch, defer: bool) -> list[list[torch.Tensor]]:
    """The first draft's backward, with the second's run inside it: after the first's later steps added
    their weight gradients to its running sums, before its step 0 and its sums' hand-over."""
    params = [[p for p in draft.parameters() if p.requires_grad] for draft in drafts]
    first_loss, first_states = loss_of(drafts[0], batch, defer)
    second_loss, _ = loss_of(drafts[1], batch, defer)
    inner: list[list[torch.Tensor]] = []

    def run_second(grad: torch.Tensor) -> torch.Tensor:
        inner.append(list(torch.autograd.grad(second_loss, params[1])))
        return grad

    first_states[0].register_hook(run_second)
    return [list(torch.autograd.grad(first_loss, params[0])), *inner]


def test_a_backward_inside_another_keeps_each_drafts_own_sums() -> None:
    drafts = (tiny_draft(seed=1), tiny_draft(seed=2))
    batch = random_batch(drafts[0], [5, 4])
    deferred, summed = gradients(drafts, batch, defer=True), gradients(drafts, batch, defer=False)
    for got, want in zip(deferred, summed, strict=True):
        for deferred_grad, summed_grad in zip(got, want, strict=True):
            assert deferred_grad is not None
            torch.testing.assert_close(deferred_grad, summed_grad, rtol=1e-10, atol=1e-12)
