"""Soft cross-entropy rows as one hand-written Triton kernel (GPU): the same function as
`loss.soft_ce_rows` (the torch reference, used on CPU and compared against this in the GPU benchmark).

One program per row, two passes over its Vd columns. Pass 1 keeps online (rescaled) softmax statistics of
the draft logits x and of the target logits t together: max and sum of exp for each, the sum of
exp(t - m_t) * x, and x's first argmax. Then
    CE = -sum_j p_j log_softmax(x)_j = m_x + log Z_x - sum_j exp(t_j - m_t) x_j / Z_t
(sum_j p_j = 1). Pass 2 overwrites x in place with d loss / d logits = w * (softmax(x) - p). Each element is
read twice from each input and written once: ~10 bytes per element in bf16, against torch.compile's
split reduction (several passes, ~5x the byte floor in the profile).
The target row of each draft row is read through an index (no gathered [C, Vd] copy).

Imports triton at module import: import this only where triton is installed (the GPU)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048


@triton.jit
def _soft_ce_rows_kernel(
    logits_ptr,  # [C, Vd] in/out: draft logits in, d loss / d logits out
    target_ptr,  # [M, Vd] target logits
    target_rows_ptr,  # [C] row of target_ptr scored against each logits row
    weights_ptr,  # [C] row weights
    loss_ptr,  # [C] out: weighted CE per row (fp32)
    top1_ptr,  # [C] out: draft argmax per row (int64)
    vocab,
    logits_stride,
    target_stride,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    x_row = logits_ptr + row.to(tl.int64) * logits_stride
    t_row = target_ptr + tl.load(target_rows_ptr + row).to(tl.int64) * target_stride
    weight = tl.load(weights_ptr + row).to(tl.float32)
    columns = tl.arange(0, BLOCK)
    # Pass 1: online statistics (scalars, fp32). First block always holds valid columns, so maxima are finite.
    max_x = -float("inf")
    sum_x = 0.0
    max_t = -float("inf")
    sum_t = 0.0
    dot = 0.0  # sum exp(t - max_t) * x
    best = -float("inf")
    best_index = 0
    for start in range(0, vocab, BLOCK):
        offsets = start + columns
        valid = offsets < vocab
        x = tl.load(x_row + offsets, mask=valid, other=-float("inf")).to(tl.float32)  # [BLOCK]
        t = tl.load(t_row + offsets, mask=valid, other=-float("inf")).to(tl.float32)  # [BLOCK]
        block_max_x = tl.max(x, 0)
        block_arg = tl.argmax(x, 0)  # first maximum of the block
        best_index = tl.where(block_max_x > best, start + block_arg, best_index)  # earlier block wins ties
        best = tl.maximum(best, block_max_x)
        new_max_x = tl.maximum(max_x, block_max_x)
        sum_x = sum_x * tl.exp(max_x - new_max_x) + tl.sum(tl.exp(x - new_max_x), 0)
        max_x = new_max_x
        new_max_t = tl.maximum(max_t, tl.max(t, 0))
        scale = tl.exp(max_t - new_max_t)
        e_t = tl.exp(t - new_max_t)  # [BLOCK], 0 where masked
        sum_t = sum_t * scale + tl.sum(e_t, 0)
        dot = dot * scale + tl.sum(tl.where(valid, e_t * x, 0.0), 0)
        max_t = new_max_t
    tl.store(loss_ptr + row, weight * (max_x + tl.log(sum_x) - dot / sum_t))
    tl.store(top1_ptr + row, best_index.to(tl.int64))
    # Pass 2: d loss / d logits = w * (softmax(x) - softmax(t)), written over x.
    inv_x = 1.0 / sum_x
    inv_t = 1.0 / sum_t
    for start in range(0, vocab, BLOCK):
        offsets = start + columns
        valid = offsets < vocab
        x = tl.load(x_row + offsets, mask=valid, other=0.0).to(tl.float32)
        t = tl.load(t_row + offsets, mask=valid, other=0.0).to(tl.float32)
        grad = weight * (tl.exp(x - max_x) * inv_x - tl.exp(t - max_t) * inv_t)
        tl.store(x_row + offsets, grad.to(logits_ptr.dtype.element_ty), mask=valid)


def soft_ce_rows_triton(
    logits: torch.Tensor,
    target_logits: torch.Tensor,
    target_rows: torch.Tensor,
    row_weights: torch.Tensor,
    block: int = BLOCK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`loss.soft_ce_rows` in one kernel: logits [C, Vd] (overwritten with d loss / d logits), target_logits
    [M, Vd], target_rows [C], row_weights [C] -> (weighted CE per row [C] fp32, draft argmax [C]). `block`:
    columns per load (a power of two)."""
    rows, vocab = logits.shape
    assert logits.stride(1) == 1 and target_logits.stride(1) == 1, "rows must be contiguous"
    row_loss = torch.empty(rows, dtype=torch.float32, device=logits.device)
    top1 = torch.empty(rows, dtype=torch.long, device=logits.device)
    if rows:
        _soft_ce_rows_kernel[(rows,)](
            logits,
            target_logits,
            target_rows,
            row_weights,
            row_loss,
            top1,
            vocab,
            logits.stride(0),
            target_logits.stride(0),
            BLOCK=block,
            num_warps=8,
        )
    return row_loss, top1
