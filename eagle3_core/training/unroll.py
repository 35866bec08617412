"""The train-time-test unroll of a draft (the loop vLLM's proposer runs at decode time, here over a packed
batch with every step at once): the draft supplies its blocks (`combine_aux`, `embed`, the layer,
`next_state`), training decides how the layer's `Weights` are made (cast once, handed to DDP's early
gradient sync, their gradients deferred into the GEMMs: `deferred_grad`)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from eagle3_core.draft.model import Attend, DraftLayer, Eagle3Draft, Weights, compute_dtype
from eagle3_core.training.deferred_grad import defer_gradients

GradientSync = Callable[[Weights], Weights]
"""Under DDP: takes the cast weights and returns the ones the unroll uses (gradient leaves whose all-reduce
starts as soon as each is complete: `distributed.LayerGradientSync`)."""


def unroll_weights(layer: DraftLayer, dtype: torch.dtype, gradient_sync: GradientSync | None) -> Weights:
    """The layer's projection matrices in the compute dtype, cast ONCE per unroll and shared by its steps;
    with `gradient_sync` (DDP training) the casts are handed to it outside autograd."""
    if gradient_sync is None or not torch.is_grad_enabled():
        return layer.cast_weights(dtype)
    with torch.no_grad():
        weights = layer.cast_weights(dtype)
    return gradient_sync(weights)


def ttt_states(
    draft: Eagle3Draft,
    aux: torch.Tensor,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    attend: Attend,
    ttt_steps: int,
    gradient_sync: GradientSync | None = None,
    defer_weight_gradients: bool = True,
) -> list[torch.Tensor]:
    """Train-time test over packed sequences: aux [B, T, 3, Ht], input_ids/position_ids [B, T] -> one
    pre-norm state [B, T, H] per step. Step k at index i predicts token i+k+2; its inputs are the token
    i+k+1 and (k > 0) the draft's own step k-1 state at index i (`next_state`), at position i+k. `attend`
    is called once per step, in order, with that step's (q, k, v); the caller's callable decides what
    each entry sees (in training: step-0 entries j <= i of the same document and its own chain, entries
    i of steps 1..k) and keeps the earlier steps' keys and values. `defer_weight_gradients`: each
    projection matrix's K step gradients summed inside the GEMMs (`deferred_grad`); off, autograd sums
    them (the same function; the benchmark times both)."""
    length = input_ids.shape[1]
    # Embedded once, padded with ttt_steps zero ids: step k reads a view (tokens i+k+1 at index i);
    # the padding only reaches indices whose predicted token lies past the end, never scored.
    embeds = draft.embed(F.pad(input_ids, (0, ttt_steps)))  # [B, T + K, H]
    hidden = draft.combine_aux(aux)  # [B, T, H]
    weights = unroll_weights(draft.midlayer, compute_dtype(draft.fc.weight), gradient_sync)
    if defer_weight_gradients and torch.is_grad_enabled():
        hidden, weights = defer_gradients(hidden, weights, once=("qkv_embed",))
    embed_proj = draft.midlayer.embed_projection(embeds, weights)  # [B, T + K, Nqkv], shared by the steps
    states = []
    for step in range(ttt_steps):  # step 0: target states; step k > 0: the draft's own step k-1 output
        step_embeds = embeds[:, step + 1 : step + 1 + length]
        step_proj = embed_proj[:, step + 1 : step + 1 + length]
        output = draft.midlayer(hidden, step_embeds, position_ids + step, attend, weights, step_proj)
        states.append(output)
        hidden = draft.next_state(output)
    return states
