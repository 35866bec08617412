"""The flash TTT attention's algebra on the CPU: one softmax over the union of the step-0 keys (a kernel
given the MERGED output and lse in backward) and the chain's diagonal equals the eager attention, output
and every gradient, over packed documents in several rows; and the loader's document spans."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from eagle3_core.training.attention import document_causal_mask, ttt_attention_eager
from eagle3_core.training.batches import collate_host
from eagle3_core.training.flash_ttt import ReferenceKernel, UnionAttention, document_spans, document_starts


def random_steps(batch: int, heads: int, kv_heads: int, length: int, dim: int, steps: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)

    def tensor(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64, requires_grad=True)

    queries = [tensor(batch, heads, length, dim) for _ in range(steps)]
    keys = [tensor(batch, kv_heads, length, dim) for _ in range(steps)]
    values = [tensor(batch, kv_heads, length, dim) for _ in range(steps)]
    return queries, keys, values


@pytest.mark.parametrize("steps", [1, 4])
def test_union_attention_equals_eager_in_output_and_every_gradient(steps: int) -> None:
    """Each step's queries see step-0 keys of their own document and their chain: outputs of all steps
    and the gradients of every q, k, v (summed loss over the steps, as the unroll's) equal the eager path."""
    document_ids = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, 2, -1], [5, 5, 5, 5, 5, 5, 7, 7, -1, -1]])
    queries, keys, values = random_steps(2, 4, 2, 10, 8, steps)
    weights = [torch.randn(2, 4, 10, 8, dtype=torch.float64) for _ in range(steps)]
    mask = document_causal_mask(document_ids)
    union = UnionAttention(document_spans(document_ids), ReferenceKernel())
    results = []
    for attend in (
        lambda k: union(queries[k], keys[k], values[k]),
        lambda k: ttt_attention_eager(queries[k], keys[: k + 1], values[: k + 1], mask),
    ):
        outputs = [attend(k) for k in range(steps)]
        loss = sum((out * weight).sum() for out, weight in zip(outputs, weights, strict=True))
        grads = torch.autograd.grad(loss, [*queries, *keys, *values])
        results.append([*outputs, *grads])
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)  # the merge computes in fp32


def test_document_starts_split_rows_and_documents_and_refuse_a_split_document() -> None:
    document_ids = torch.tensor([[0, 0, 1, 1, 1, -1], [3, 3, 3, 3, 3, 3]])
    assert document_starts(document_ids).tolist() == [0, 2, 5, 6, 12]
    assert document_spans(document_ids).longest == 6
    with pytest.raises(ValueError, match="split into several runs"):
        document_starts(torch.tensor([[0, 0, 1, 0]]))


def test_the_loader_makes_the_document_starts_of_its_padded_batch() -> None:
    def item(length: int, documents: list[int]) -> dict[str, torch.Tensor]:
        return {
            "input_ids": torch.zeros(length, dtype=torch.long),
            "document_ids": torch.tensor(documents),
            "loss_mask": torch.ones(length, dtype=torch.bool),
        }

    batch = collate_host([item(3, [0, 0, 1]), item(5, [0, 1, 1, 1, 2])], pad_multiple=8, ttt_steps=2)
    assert batch["document_starts"].tolist() == [0, 2, 3, 8, 9, 12, 13, 16]


TRITON_CHECK = """
import torch
from eagle3_core.training.diagonal_triton import merge_diagonal_backward_triton, merge_diagonal_forward_triton
from eagle3_core.training.flash_ttt import merge_diagonal_backward, merge_diagonal_forward

torch.manual_seed(0)
for heads, kv_heads, dim, steps in ((6, 2, 12, 3), (4, 4, 8, 1)):  # G = 3 and D = 12: masked lanes
    rows = 5
    q, out0, d_out = (torch.randn(rows, heads, dim) for _ in range(3))
    lse0 = torch.randn(heads, rows)
    keys, values = torch.randn(steps, rows, kv_heads, dim), torch.randn(steps, rows, kv_heads, dim)
    dq_causal = torch.randn(rows, heads, dim)
    want = merge_diagonal_forward(q, out0, lse0, keys, values)
    got = merge_diagonal_forward_triton(q, out0, lse0, keys, values)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    out, lse = want
    want = merge_diagonal_backward(q, keys, values, out, lse, d_out, dq_causal)
    got = merge_diagonal_backward_triton(q, keys, values, out, lse, d_out, dq_causal.clone())
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
print("OK")
"""


def test_triton_diagonal_merge_kernels_match_torch_references() -> None:
    """The GPU kernels' logic, run by Triton's interpreter on the CPU, against the torch merge forward and
    backward (themselves checked against eager attention above), with masked head-group and dim lanes."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, "-c", TRITON_CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "OK", result.stderr[-3000:]
