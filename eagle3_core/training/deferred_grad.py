"""Deferred weight gradients: the TTT steps' weight gradients of a projection matrix summed by the GEMMs'
own accumulator, instead of by K - 1 full-size adds.

The draft layer's projection matrices are used by every TTT step of an unroll. Left to autograd, each step's
backward makes its own weight gradient (one GEMM) and autograd sums the K of them: K - 1 adds of every matrix
(`CUDAFunctor_add`, 2.3 ms of a 68 ms step on an H200 at 2048 tokens, TTT 7). Here each step's product is
the custom op `eagle3::deferred_linear` on the DETACHED matrix: its backward computes the input's gradient
and adds gy^T x into the matrix's running sum in the same GEMM (`addmm_`, beta = 1). `WeightGradients`, an
identity on the unroll's first state that takes the matrices as extra inputs, is the one place autograd
sees them: its backward, which runs only after every step's backward (every later state depends on the
first), hands each matrix its sum. Same function; the K-fold sum happens in the GEMM epilogue.

The products are registered custom ops (not autograd.Functions) so that torch.compile'd blocks keep them in
their graphs; the running sums live outside any graph, so no compiled buffer is ever retained. A sum is kept
per matrix of an unroll (its name and its storage), so unrolls of two drafts in one process never mix.
The draft layer only calls `Weights.project`; `DeferredWeights` is training's implementation of it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from eagle3_core.draft.model import Weights

SumKey = tuple[str, int]  # (matrix name, the unroll's matrix storage)
_SUMS: dict[SumKey, torch.Tensor] = {}  # sum of gy^T x over the steps whose backward has run


def sum_key(name: str, weight: torch.Tensor) -> SumKey:
    return name, weight.untyped_storage().data_ptr()


@torch.library.custom_op("eagle3::deferred_linear", mutates_args=())
def deferred_linear(x: torch.Tensor, weight: torch.Tensor, name: str, base: torch.Tensor | None = None) -> torch.Tensor:
    """[base +] x [..., in] @ weight [out, in]^T -> [..., out] (with `base`: x and base 2-D, added inside the
    GEMM); backward adds the weight's gradient to the running sum of `name`."""
    return F.linear(x, weight) if base is None else torch.addmm(base, x, weight.t())


@deferred_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, name: str, base: torch.Tensor | None = None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op("eagle3::deferred_linear_input_grad", mutates_args=())
def deferred_linear_input_grad(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, name: str) -> torch.Tensor:
    """grad @ weight (the input's gradient); the weight's, grad^T x, is added to the running sum of `name`."""
    rows_grad, rows_x = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])  # [rows, out], [rows, in]
    key = sum_key(name, weight)
    if key in _SUMS:
        _SUMS[key].addmm_(rows_grad.t(), rows_x)
    else:
        _SUMS[key] = rows_grad.t() @ rows_x  # [out, in]
    return grad @ weight


@deferred_linear_input_grad.register_fake
def _(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, name: str) -> torch.Tensor:
    return torch.empty_like(x)


def _keep_inputs(ctx, inputs, output) -> None:
    x, weight, name, base = inputs
    ctx.save_for_backward(x, weight)
    ctx.name, ctx.has_base = name, base is not None


def _input_grad_only(ctx, grad):
    x, weight = ctx.saved_tensors
    return deferred_linear_input_grad(grad, x, weight, ctx.name), None, None, grad if ctx.has_base else None


deferred_linear.register_autograd(_input_grad_only, setup_context=_keep_inputs)


class WeightGradients(torch.autograd.Function):
    """Identity on the unroll's first state [B, T, H], with the deferred matrices as extra inputs; backward
    (after every step's) passes the state's gradient through and gives each matrix its summed gradient."""

    @staticmethod
    def forward(ctx, state: torch.Tensor, names: tuple[str, ...], *weights: torch.Tensor) -> torch.Tensor:
        ctx.keys = [sum_key(name, weight) for name, weight in zip(names, weights, strict=True)]
        for key in ctx.keys:
            _SUMS.pop(key, None)  # an unroll whose backward never ran leaves nothing behind
        return state.view_as(state)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return (grad, None, *(_SUMS.pop(key, None) for key in ctx.keys))


class DeferredWeights(Weights):
    """`Weights` of one training unroll: the per-step matrices detached, their gradients made by
    `WeightGradients` (`defer_gradients`); with gradients on, the layer's products go through
    `deferred_linear`, otherwise (validation) they are plain products."""

    def project(self, x: torch.Tensor, name: str, base: torch.Tensor | None = None) -> torch.Tensor:
        if torch.is_grad_enabled():
            return deferred_linear(x, self[name], name, base)
        return super().project(x, name, base)


def defer_gradients(
    state: torch.Tensor, weights: dict[str, torch.Tensor], once: tuple[str, ...]
) -> tuple[torch.Tensor, DeferredWeights]:
    """(first state behind `WeightGradients`, `DeferredWeights`) for an unroll; `once`: matrices used once
    per unroll, outside the steps, which keep their own gradient (their backward has no fixed order with the
    first state's)."""
    names = tuple(name for name, weight in weights.items() if name not in once and weight.requires_grad)
    state = WeightGradients.apply(state, names, *(weights[name] for name in names))
    return state, DeferredWeights({name: w.detach() if name in names else w for name, w in weights.items()})
