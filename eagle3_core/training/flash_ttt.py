"""Train-time-test attention on flash-attention kernels: the `flash` backend of `TTTAttention` (GPU).

At TTT step k a query attends, in ONE softmax, to the union of two key sets: the step-0 entries of its own
document up to itself (causal: one varlen flash kernel over the packed documents) and its own chain's
entries at steps 1..k (the diagonal: k scores per query, in closed form). Forward merges the kernel's
output and log-sum-exp with the diagonal.

Backward needs no kernel of its own. A flash backward recomputes P = exp(s - lse) and D = rowsum(dO * O)
from the lse and the output it is GIVEN; handed the union's (merged) output and lse, it returns exactly the
causal keys' share of the union's gradients (the identity that lets ring attention split one softmax
over devices). The diagonal's share is elementwise. So each step costs one flash forward and one flash
backward, instead of flex_attention's generated template.

`FlashKernel` runs PyTorch's bundled FlashAttention-2 (`aten._flash_attention_forward/backward`, CUDA,
bf16/fp16, Dv = D); `ReferenceKernel` is the same contract in explicit scores (any device and dtype), so the
CPU tests check the merge and its backward against the eager attention of `attention.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Protocol

import torch


@dataclass(frozen=True)
class DocumentSpans:
    """Packed documents as varlen kernels take them, over the flattened [B*T] rows (`document_spans`)."""

    starts: torch.Tensor  # int32 [n + 1]: first row of each document, then B*T
    longest: int  # an upper bound of a document's rows (the padded row length T: no host sync to find it)


def document_starts(document_ids: torch.Tensor) -> torch.Tensor:
    """document_ids [B, T] -> int32 [n + 1]: the flattened row where each document begins (a new one where
    the id changes or a row begins), then B*T. Made by the loader on the CPU (on a GPU: one host sync).
    Raises ValueError if a document is split into several runs, which a packed batch never is."""
    batch, length = document_ids.shape
    flat = document_ids.reshape(-1)
    begins = torch.ones_like(flat, dtype=torch.bool)
    begins[1:] = flat[1:] != flat[:-1]
    begins[::length] = True
    runs = begins.view(batch, length).sum(1).tolist()
    if runs != [len(row.unique()) for row in document_ids]:
        raise ValueError("document_ids: a document is split into several runs; packed documents must be contiguous")
    end = torch.tensor([batch * length], device=flat.device)
    return torch.cat([begins.nonzero()[:, 0], end]).to(torch.int32)


def document_spans(document_ids: torch.Tensor, starts: torch.Tensor | None = None) -> DocumentSpans:
    """The spans of document_ids [B, T], from `document_starts` (computed here unless given)."""
    return DocumentSpans(document_starts(document_ids) if starts is None else starts, document_ids.shape[1])


class CausalKernel(Protocol):
    """Document-causal attention over flattened rows: q [N, Hq, D], k/v [N, Hkv, D] (Hq a multiple of Hkv),
    scores scaled by 1/sqrt(D). forward -> (out [N, Hq, D], lse [Hq, N] fp32, state for backward);
    backward(d_out, q, k, v, out, lse, spans, state) -> (dq, dk, dv), P recomputed from the GIVEN lse/out."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spans: DocumentSpans
    ) -> tuple[torch.Tensor, torch.Tensor, tuple]: ...

    def backward(self, d_out, q, k, v, out, lse, spans: DocumentSpans, state: tuple) -> tuple: ...


class FlashKernel:
    """PyTorch's FlashAttention-2, varlen (`cum_seq` = the document starts), causal within each document."""

    def forward(self, q, k, v, spans):
        out, lse, rng_state, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, spans.starts, spans.starts, spans.longest, spans.longest, 0.0, True, False
        )  # out [N, Hq, D], lse [Hq, N]
        return out, lse, (rng_state, unused)

    def backward(self, d_out, q, k, v, out, lse, spans, state):
        rng_state, unused = state
        return torch.ops.aten._flash_attention_backward(
            d_out, q, k, v, out, lse, spans.starts, spans.starts, spans.longest, spans.longest, 0.0, True,
            rng_state, unused,
        )  # fmt: skip


def _span_mask(spans: DocumentSpans, rows: int, device: torch.device) -> torch.Tensor:
    """[N, N] bool: key j visible to query i (same document, j <= i)."""
    document = torch.zeros(rows, dtype=torch.long, device=device)
    document[spans.starts[1:-1].long()] = 1
    document = document.cumsum(0)
    index = torch.arange(rows, device=device)
    return (document[:, None] == document[None]) & (index[None] <= index[:, None])


class ReferenceKernel:
    """`CausalKernel` in explicit fp32 scores, backward written out as flash computes it."""

    def _probs(self, q, k, spans, lse=None):
        rows, heads, dim = q.shape
        group = heads // k.shape[1]
        keys = k.float().repeat_interleave(group, dim=1)  # [N, Hq, D]
        scores = torch.einsum("ihd,jhd->hij", q.float(), keys) * dim**-0.5  # [Hq, N, N]
        scores = scores.masked_fill(~_span_mask(spans, rows, q.device), float("-inf"))
        lse = scores.logsumexp(-1) if lse is None else lse
        return (scores - lse[..., None]).exp(), lse, keys

    def forward(self, q, k, v, spans):
        probs, lse, _ = self._probs(q, k, spans)
        values = v.float().repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        return torch.einsum("hij,jhd->ihd", probs, values).to(q.dtype), lse, ()

    def backward(self, d_out, q, k, v, out, lse, spans, state):
        rows, heads, dim = q.shape
        group = heads // k.shape[1]
        probs, _, keys = self._probs(q, k, spans, lse)
        values = v.float().repeat_interleave(group, dim=1)
        delta = (d_out.float() * out.float()).sum(-1).t()  # [Hq, N]
        d_probs = torch.einsum("ihd,jhd->hij", d_out.float(), values)
        d_scores = probs * (d_probs - delta[..., None]) * dim**-0.5  # [Hq, N, N]
        dq = torch.einsum("hij,jhd->ihd", d_scores, keys)
        dk = torch.einsum("hij,ihd->jhd", d_scores, q.float()).view(rows, -1, group, dim).sum(2)
        dv = torch.einsum("hij,ihd->jhd", probs, d_out.float()).view(rows, -1, group, dim).sum(2)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _diagonal_scores(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """q [N, Hq, D], keys [S, N, Hkv, D] -> fp32 scores with each query's own chain entries [S, N, Hq]."""
    rows, heads, dim = q.shape
    grouped = q.view(rows, keys.shape[2], heads // keys.shape[2], dim).float()  # [N, Hkv, G, D]
    return (grouped[None] * keys[:, :, :, None].float()).sum(-1).view(-1, rows, heads) * dim**-0.5


def merge_diagonal_forward(q, out0, lse0, keys, values) -> tuple[torch.Tensor, torch.Tensor]:
    """Union of the causal part (out0 [N, Hq, D], lse0 [Hq, N]) and the diagonal (keys/values [S, N, Hkv, D])
    -> (out [N, Hq, D] in q's dtype, lse [Hq, N] fp32)."""
    rows, heads, _ = q.shape
    scores = torch.cat([lse0.t()[None], _diagonal_scores(q, keys)])  # [1 + S, N, Hq]
    lse = scores.logsumexp(0)  # [N, Hq]
    weights = (scores - lse).exp()
    grouped = weights[1:].view(-1, rows, keys.shape[2], heads // keys.shape[2], 1)  # [S, N, Hkv, G, 1]
    diagonal = (grouped * values[:, :, :, None].float()).sum(0).view(rows, heads, -1)
    out = weights[0, ..., None] * out0.float() + diagonal
    return out.to(q.dtype), lse.t().contiguous()


def merge_diagonal_backward(q, keys, values, out, lse, d_out, dq_causal) -> tuple[torch.Tensor, ...]:
    """The union's gradients: dq = the causal kernel's dq_causal + the diagonal's share ([N, Hq, D] in q's
    dtype), d_keys and d_values [S, N, Hkv, D] of the chain entries."""
    rows, heads, dim = q.shape
    kv_heads = keys.shape[2]
    weights = (_diagonal_scores(q, keys) - lse.t()).exp()  # [S, N, Hq]
    delta = (d_out.float() * out.float()).sum(-1)  # [N, Hq]
    d_grouped = d_out.float().view(rows, kv_heads, heads // kv_heads, dim)  # [N, Hkv, G, D]
    d_weights = (d_grouped[None] * values[:, :, :, None].float()).sum(-1).view(-1, rows, heads)  # [S, N, Hq]
    d_scores = (weights * (d_weights - delta) * dim**-0.5).view(-1, rows, kv_heads, heads // kv_heads, 1)
    q_grouped = q.float().view(rows, kv_heads, heads // kv_heads, dim)
    dq = dq_causal.float() + (d_scores * keys[:, :, :, None].float()).sum(0).view(rows, heads, dim)
    d_keys = (d_scores * q_grouped[None]).sum(3)
    d_values = (weights.view_as(d_scores) * d_grouped[None]).sum(3)
    return dq.to(q.dtype), d_keys.to(keys.dtype), d_values.to(values.dtype)


@cache
def _merge_functions(on_gpu: bool) -> tuple:
    """(forward, backward) of the diagonal merge: the Triton kernels on a GPU, the torch references elsewhere."""
    if not on_gpu:
        return merge_diagonal_forward, merge_diagonal_backward
    from eagle3_core.training.diagonal_triton import merge_diagonal_backward_triton, merge_diagonal_forward_triton

    return merge_diagonal_forward_triton, merge_diagonal_backward_triton


class _UnionAttention(torch.autograd.Function):
    """One TTT step: q [N, Hq, D]; k0/v0 [N, Hkv, D] (step 0); keys/values [S, N, Hkv, D] (steps 1..S, S >= 0)."""

    @staticmethod
    def forward(ctx, q, k0, v0, keys, values, spans, kernel):
        out, lse, state = kernel.forward(q, k0, v0, spans)
        merge_forward, ctx.merge_backward = _merge_functions(q.is_cuda)
        if keys.shape[0]:
            out, lse = merge_forward(q, out, lse, keys, values)
        ctx.save_for_backward(q, k0, v0, keys, values, out, lse)
        ctx.spans, ctx.kernel, ctx.state = spans, kernel, state
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k0, v0, keys, values, out, lse = ctx.saved_tensors
        d_out = d_out.contiguous()
        dq, dk0, dv0 = ctx.kernel.backward(d_out, q, k0, v0, out, lse, ctx.spans, ctx.state)
        if not keys.shape[0]:
            return dq, dk0, dv0, None, None, None, None
        dq, d_keys, d_values = ctx.merge_backward(q, keys, values, out, lse, d_out, dq)
        return dq, dk0, dv0, d_keys, d_values, None, None


class UnionAttention:
    """The `attend` callable of one unroll on a `CausalKernel` (`TTTAttention`'s contract: q [B, Hq, T, D],
    k/v [B, Hkv, T, D] per call, one call per step -> [B, Hq, T, D]). Rows are flattened once per step to
    [B*T, heads, D], as varlen kernels take them, and kept for the later steps."""

    def __init__(self, spans: DocumentSpans, kernel: CausalKernel):
        self.spans, self.kernel = spans, kernel
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        batch, heads, length, _ = q.shape

        def rows(x: torch.Tensor) -> torch.Tensor:  # [B, H, T, D] -> [B*T, H, D] (a view when T-major)
            return x.transpose(1, 2).reshape(batch * length, x.shape[1], x.shape[3])

        self.keys.append(rows(k))
        self.values.append(rows(v))
        if len(self.keys) > 1:
            chain_keys, chain_values = torch.stack(self.keys[1:]), torch.stack(self.values[1:])
        else:  # no chain entries yet: S = 0
            chain_keys = chain_values = self.keys[0].new_empty((0, *self.keys[0].shape))
        out = _UnionAttention.apply(
            rows(q), self.keys[0], self.values[0], chain_keys, chain_values, self.spans, self.kernel
        )  # [B*T, Hq, D]
        return out.view(batch, length, heads, -1).transpose(1, 2)
