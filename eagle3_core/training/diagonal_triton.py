"""The diagonal merge of the flash TTT attention as two hand-written Triton kernels (GPU): the same functions
as `flash_ttt.merge_diagonal_forward` / `merge_diagonal_backward` (the torch references, used on the CPU
and compared against these by the CPU test through Triton's interpreter).

One program per (row, kv head): it holds the group's G query heads [G, D] in registers and walks the S chain
entries of that kv head, so every tensor is read once and written once. Forward: online softmax over
[lse0 | chain scores], out = (e^lse0 out0 + sum_s e^s_s v_s) / Z and the merged lse. Backward: with the
merged out/lse, p_s = e^(score_s - lse), the chain's dk_s / dv_s, and dq = the causal kernel's dq + the
chain's share, in one pass. (torch.compile's version of the same math launched ~6 reductions per step over
[S, N, Hkv, G, D] broadcasts: ~1 ms a step at 2048 tokens, against ~0.05 ms of bytes.)

Imports triton at module import: import this only where triton is installed (the GPU)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# The tiles are small ([G, D] per program): with one warp the backward's reductions over the group's heads
# stay inside the warp (shuffles, no shared-memory round trip per chain entry).
WARPS = 1


@triton.jit
def _program_tile(GROUP: tl.constexpr, DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr):
    """This program's (row, kv head), its G query heads, and their [G, D] tile's offsets into [N, Hq, D]."""
    row = tl.program_id(0).to(tl.int64)
    kv = tl.program_id(1)
    g, d = tl.arange(0, BLOCK_G), tl.arange(0, BLOCK_D)
    g_ok = g < GROUP
    head = kv * GROUP + g  # [G]
    offsets = (row * tl.num_programs(1) * GROUP + head)[:, None] * DIM + d[None, :]  # [G, D]
    return row, kv, head, offsets, g_ok[:, None] & (d < DIM)[None, :], g_ok


@triton.jit
def _chain_entry(keys_ptr, values_ptr, s, rows, row, kv, DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Chain entry s of this program's (row, kv head): its offsets into [S, N, Hkv, D], lanes, k and v [D] fp32."""
    d = tl.arange(0, BLOCK_D)
    d_ok = d < DIM
    entry = ((s * rows + row) * tl.num_programs(1) + kv) * DIM + d  # [D]
    k = tl.load(keys_ptr + entry, mask=d_ok, other=0.0).to(tl.float32)
    v = tl.load(values_ptr + entry, mask=d_ok, other=0.0).to(tl.float32)
    return entry, d_ok, k, v


@triton.jit
def _merge_forward_kernel(
    q_ptr,  # [N, Hq, D]
    out0_ptr,  # [N, Hq, D] attention over the step-0 keys
    lse0_ptr,  # [Hq, N] its log-sum-exp (fp32)
    keys_ptr,  # [S, N, Hkv, D] chain keys
    values_ptr,  # [S, N, Hkv, D] chain values
    out_ptr,  # [N, Hq, D] out: the union's attention
    lse_ptr,  # [Hq, N] out: the union's log-sum-exp
    rows,
    steps,
    scale,
    GROUP: tl.constexpr,
    DIM: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    row, kv, head, offsets, mask, g_ok = _program_tile(GROUP, DIM, BLOCK_G, BLOCK_D)
    q = tl.load(q_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    acc = tl.load(out0_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    top = tl.load(lse0_ptr + head * rows + row, mask=g_ok, other=0.0)  # [G] running max
    total = tl.full([BLOCK_G], 1.0, tl.float32)  # sum of e^(score - top); out0 weighs e^(lse0 - top)
    for s in range(steps):
        _, _, k, v = _chain_entry(keys_ptr, values_ptr, s, rows, row, kv, DIM, BLOCK_D)
        score = tl.sum(q * k[None, :], 1) * scale  # [G]
        new_top = tl.maximum(top, score)
        rescale, weight = tl.exp(top - new_top), tl.exp(score - new_top)
        total = total * rescale + weight
        acc = acc * rescale[:, None] + weight[:, None] * v[None, :]
        top = new_top
    tl.store(out_ptr + offsets, (acc / total[:, None]).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(lse_ptr + head * rows + row, top + tl.log(total), mask=g_ok)


@triton.jit
def _merge_backward_kernel(
    q_ptr,  # [N, Hq, D]
    keys_ptr,  # [S, N, Hkv, D]
    values_ptr,  # [S, N, Hkv, D]
    out_ptr,  # [N, Hq, D] the union's attention (forward's output)
    lse_ptr,  # [Hq, N] the union's log-sum-exp
    d_out_ptr,  # [N, Hq, D]
    dq_ptr,  # [N, Hq, D] in: the causal kernel's dq; out: plus the chain's share
    d_keys_ptr,  # [S, N, Hkv, D] out
    d_values_ptr,  # [S, N, Hkv, D] out
    rows,
    steps,
    scale,
    GROUP: tl.constexpr,
    DIM: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    row, kv, head, offsets, mask, g_ok = _program_tile(GROUP, DIM, BLOCK_G, BLOCK_D)
    q = tl.load(q_ptr + offsets, mask=mask, other=0.0).to(tl.float32)  # [G, D]
    d_out = tl.load(d_out_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    delta = tl.sum(d_out * tl.load(out_ptr + offsets, mask=mask, other=0.0).to(tl.float32), 1)  # [G]
    lse = tl.load(lse_ptr + head * rows + row, mask=g_ok, other=0.0)
    dq = tl.load(dq_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    for s in range(steps):
        entry, d_ok, k, v = _chain_entry(keys_ptr, values_ptr, s, rows, row, kv, DIM, BLOCK_D)
        p = tl.exp(tl.sum(q * k[None, :], 1) * scale - lse)  # [G]; masked heads: d_out = 0 zeroes them
        d_score = p * (tl.sum(d_out * v[None, :], 1) - delta) * scale  # [G]
        dq += d_score[:, None] * k[None, :]
        tl.store(d_keys_ptr + entry, tl.sum(d_score[:, None] * q, 0).to(d_keys_ptr.dtype.element_ty), mask=d_ok)
        tl.store(d_values_ptr + entry, tl.sum(p[:, None] * d_out, 0).to(d_values_ptr.dtype.element_ty), mask=d_ok)
    tl.store(dq_ptr + offsets, dq.to(dq_ptr.dtype.element_ty), mask=mask)


def _launch_shape(q: torch.Tensor, keys: torch.Tensor) -> tuple[tuple[int, int], dict]:
    """Grid (one program per row and kv head) and the kernels' shape arguments."""
    rows, heads, dim = q.shape
    kv_heads = keys.shape[2]
    meta = {
        "rows": rows,
        "steps": keys.shape[0],
        "scale": dim**-0.5,
        "GROUP": heads // kv_heads,
        "DIM": dim,
        "BLOCK_G": triton.next_power_of_2(heads // kv_heads),
        "BLOCK_D": triton.next_power_of_2(dim),
    }
    return (rows, kv_heads), meta


def merge_diagonal_forward_triton(q, out0, lse0, keys, values, num_warps: int = WARPS) -> tuple[torch.Tensor, ...]:
    """`flash_ttt.merge_diagonal_forward` in one kernel: q/out0 [N, Hq, D], lse0 [Hq, N], keys/values
    [S, N, Hkv, D] -> (out [N, Hq, D] in q's dtype, lse [Hq, N] fp32)."""
    q, out0, lse0, keys, values = (t.contiguous() for t in (q, out0, lse0.float(), keys, values))
    out, lse = torch.empty_like(q), torch.empty_like(lse0)
    grid, meta = _launch_shape(q, keys)
    _merge_forward_kernel[grid](q, out0, lse0, keys, values, out, lse, **meta, num_warps=num_warps)
    return out, lse


def merge_diagonal_backward_triton(
    q, keys, values, out, lse, d_out, dq_causal, num_warps: int = WARPS
) -> tuple[torch.Tensor, ...]:
    """`flash_ttt.merge_diagonal_backward` in one kernel -> (dq [N, Hq, D] in q's dtype, d_keys, d_values)."""
    q, keys, values, out, lse, d_out = (t.contiguous() for t in (q, keys, values, out, lse, d_out))
    dq = dq_causal.to(q.dtype).contiguous()  # the causal kernel's fresh output, completed in place
    d_keys, d_values = torch.empty_like(keys), torch.empty_like(values)
    grid, meta = _launch_shape(q, keys)
    _merge_backward_kernel[grid](q, keys, values, out, lse, d_out, dq, d_keys, d_values, **meta, num_warps=num_warps)
    return dq, d_keys, d_values
