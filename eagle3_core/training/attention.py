"""Train-time-test attention over packed sequences.

At TTT step k the query at index i (the chain that starts after position i, now at position i+k) sees:
the step-0 entries j <= i of its own document (states from the target), and its own chain's entries, i.e.
index i of steps 1..k (states from the draft). That is what a chain sees in vLLM at decoding time.

Three implementations of the same function:
- `flash` (GPU, values as wide as keys): FlashAttention-2 over the step-0 keys of the packed documents and
  the diagonal in closed form, one softmax over their union (`flash_ttt.py`: why its backward is exact).
- `flex` (GPU, any head dims): flex_attention over the step-0 keys with ONE document-causal block mask per batch,
  returning the log-sum-exp, merged with the k diagonal scores in closed form. The block mask is built
  once per batch and reused by every step; no [T, T] mask or score matrix is materialised.
- `eager` (any device; the CPU path, since flex_attention has no CPU backward): explicit scores with a
  boolean document-causal mask and the diagonal scores appended before one softmax.
"""

from __future__ import annotations

from functools import cache

import torch

from eagle3_core.training.flash_ttt import FlashKernel, UnionAttention, document_spans, merge_diagonal_forward

Mask = torch.Tensor


def document_causal_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """document_ids [B, T] -> bool [B, 1, T, T]: True where query i may attend key j (j <= i, same doc)."""
    length = document_ids.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=document_ids.device).tril()
    same_document = document_ids[:, :, None] == document_ids[:, None, :]  # [B, T, T]
    return (causal & same_document)[:, None]


def document_block_mask(document_ids: torch.Tensor):
    """The flex_attention BlockMask of `document_causal_mask` (fully masked blocks are skipped)."""
    from torch.nn.attention.flex_attention import create_block_mask

    batch, length = document_ids.shape

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (document_ids[b, q_idx] == document_ids[b, kv_idx])

    return create_block_mask(mask_mod, batch, None, length, length, device=document_ids.device)


def _grouped(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[B, Hq, T, D] -> [B, Hkv, G, T, D] (grouped-query view, no copy)."""
    batch, heads, length, dim = x.shape
    return x.view(batch, kv_heads, heads // kv_heads, length, dim)


def diagonal_scores(q: torch.Tensor, keys: list[torch.Tensor]) -> torch.Tensor:
    """q [B, Hq, T, D], keys[j] [B, Hkv, T, D] -> fp32 scores of each query with its own chain's entries
    at steps 1..k: [B, Hq, T, k] (scaled by 1/sqrt(D))."""
    batch, heads, length, dim = q.shape
    grouped = _grouped(q, keys[0].shape[1]).float()
    scores = [(grouped * key[:, :, None].float()).sum(-1) for key in keys[1:]]  # each [B, Hkv, G, T]
    return torch.stack(scores, dim=-1).view(batch, heads, length, len(keys) - 1) * dim**-0.5


def weighted_diagonal_values(weights: torch.Tensor, values: list[torch.Tensor]) -> torch.Tensor:
    """weights [B, Hq, T, k] fp32, values[j] [B, Hkv, T, Dv] for steps 1..k -> [B, Hq, T, Dv] fp32."""
    batch, heads, length, steps = weights.shape
    grouped = weights.view(batch, values[0].shape[1], heads // values[0].shape[1], length, steps)
    out = sum(grouped[..., j, None] * value[:, :, None].float() for j, value in enumerate(values))
    return out.reshape(batch, heads, length, -1)


def ttt_attention_eager(
    q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], mask: Mask
) -> torch.Tensor:
    """Explicit-score TTT attention. q [B, Hq, T, D]; keys [B, Hkv, T, D] and values [B, Hkv, T, Dv]: one
    per step so far (step 0 first); mask [B, 1, T, T] bool. Returns [B, Hq, T, Dv] in q's dtype."""
    batch, heads, length, dim = q.shape
    kv_heads = keys[0].shape[1]
    grouped_q = _grouped(q, kv_heads)  # [B, Hkv, G, T, D]
    scores = grouped_q.float() @ keys[0][:, :, None].float().transpose(-1, -2)  # [B, Hkv, G, T, T]
    scores = scores.view(batch, heads, length, length) * dim**-0.5
    scores = scores.masked_fill(~mask, float("-inf"))
    if len(keys) > 1:
        scores = torch.cat([scores, diagonal_scores(q, keys)], dim=-1)  # [B, Hq, T, T + k]
    probs = torch.softmax(scores, dim=-1)
    causal_probs = _grouped(probs[..., :length].contiguous(), kv_heads)  # [B, Hkv, G, T, T]
    out = (causal_probs @ values[0][:, :, None].float()).view(batch, heads, length, -1)  # [B, Hq, T, Dv]
    if len(keys) > 1:
        out = out + weighted_diagonal_values(probs[..., length:], values[1:])
    return out.to(q.dtype)


def merge_diagonal(
    q: torch.Tensor, out0: torch.Tensor, lse0: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
) -> torch.Tensor:
    """Merge attention over step-0 entries (out0 [B, Hq, T, Dv], log-sum-exp lse0 [B, Hq, T]) with each
    query's own chain entries keys [S, B, Hkv, T, D] / values [S, B, Hkv, T, Dv] (steps 1..S):
    out = (e^lse0 * out0 + sum_j e^s_j * v_j) / (e^lse0 + sum_j e^s_j), computed stably in fp32 by the flash
    path's `merge_diagonal_forward` on rows flattened to [B*T, heads, D]."""
    batch, heads, length, _ = q.shape

    def rows(x: torch.Tensor) -> torch.Tensor:  # [..., B, H, T, D] -> [..., B*T, H, D]
        return x.transpose(-3, -2).flatten(-4, -3)

    flat_lse = lse0.transpose(0, 1).reshape(heads, batch * length)  # [Hq, B*T]
    out, _ = merge_diagonal_forward(rows(q), rows(out0), flat_lse, rows(keys), rows(values))  # [B*T, Hq, Dv]
    return out.view(batch, length, heads, -1).transpose(1, 2)


@cache
def _compiled_flex_attention():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


@cache
def _compiled_merge_diagonal():
    return torch.compile(merge_diagonal, dynamic=True)


def ttt_attention_flex(
    q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], block_mask
) -> torch.Tensor:
    """flex_attention over step 0 (document-causal BlockMask) returning its log-sum-exp, merged with the
    diagonal entries of steps 1..k by `merge_diagonal` (compiled: one fused pass per step)."""
    out0, lse0 = _compiled_flex_attention()(
        q, keys[0], values[0], block_mask=block_mask, return_lse=True, enable_gqa=True
    )  # out0 [B, Hq, T, Dv], lse0 [B, Hq, T]
    if len(keys) == 1:
        return out0
    return _compiled_merge_diagonal()(q, out0, lse0, torch.stack(keys[1:]), torch.stack(values[1:]))


class TTTAttention:
    """The `attend` callable of one train-time-test unroll: each call is the next step; it keeps the
    step's keys/values for the steps after it."""

    def __init__(self, mask, backend: str):
        self.mask, self.backend = mask, backend
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    @classmethod
    def for_documents(
        cls, document_ids: torch.Tensor, backend: str = "auto", starts: torch.Tensor | None = None
    ) -> TTTAttention | UnionAttention:
        """`starts` (flash): the batch's `document_starts` when the loader made them (else one host sync).
        `auto` here is flex on a GPU (any head dims); `TTTObjective.attention_backend` picks flash for Llama."""
        if backend == "auto":
            backend = "flex" if document_ids.is_cuda else "eager"
        if backend == "flash":
            return UnionAttention(document_spans(document_ids, starts), FlashKernel())
        if backend == "flex":
            return cls(document_block_mask(document_ids), backend)
        if backend == "eager":
            return cls(document_causal_mask(document_ids), backend)
        raise ValueError(f"unknown attention backend {backend!r}: flash, flex, eager or auto")

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.keys.append(k)
        self.values.append(v)
        if self.backend == "flex":
            return ttt_attention_flex(q, self.keys, self.values, self.mask)
        return ttt_attention_eager(q, self.keys, self.values, self.mask)
