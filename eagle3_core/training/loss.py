"""The train-time-test objective: soft cross-entropy of each draft step against the target's distribution
restricted to the draft vocabulary (tempered by `target_temperature`), step k weighted by `step_weight**k`,
loss-masked, packed-aware.

Target logits come from the stored last-layer state through the target's lm_head rows selected by t2d
(after the target's final norm iff the stored state is pre-norm), computed once per batch and shared by
all steps: row j predicts token j+1, so draft step k at index i (which predicts token i+k+2) is scored
against target row i+k+1.

The loss never materialises full fp32 logits: `fused_soft_cross_entropy_rows` walks row chunks, computes each
chunk's logits once (straight into the buffer that keeps d loss / d logits), and a row function overwrites
them with d loss / d logits = softmax(draft) - p_target, so backward is two saved tensors times a scalar.
Row functions: `soft_ce_rows` (torch; the CPU path and the reference), its torch.compile'd chunk, and the
hand-written Triton kernel of `soft_ce_triton` (GPU).
Imports only torch (the GPU benchmark uses it without pydantic).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from eagle3_core.draft.model import Eagle3Draft
from eagle3_core.training.attention import TTTAttention
from eagle3_core.training.unroll import GradientSync, ttt_states

LOSS_CHUNK_ROWS = 4096
RowsFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""(logits [C, Vd], overwritten with d loss / d logits; target_logits [M, Vd]; target_rows [C]; row_weights
[C]) -> (weighted CE per row [C], draft argmax [C])."""


def soft_ce_chunk(
    logits: torch.Tensor, target_logits: torch.Tensor, row_weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk: draft logits [C, Vd] (compute dtype), target logits [C, Vd], row_weights [C] ->
    (weighted CE per row [C], d loss / d logits [C, Vd] in the logits' dtype, draft argmax [C]). Elementwise
    and row reductions only, so torch.compile fuses it into a pass or two over the chunk."""
    accumulate = torch.promote_types(target_logits.dtype, torch.float32)
    log_probs = torch.log_softmax(logits.to(accumulate), dim=-1)
    target_probs = torch.softmax(target_logits.to(accumulate), dim=-1)
    weights = row_weights[:, None].to(accumulate)
    row_loss = -(weights * target_probs * log_probs).sum(-1)
    grad_logits = ((log_probs.exp() - target_probs) * weights).to(logits.dtype)
    return row_loss, grad_logits, log_probs.argmax(-1)


def soft_ce_rows(
    logits: torch.Tensor,
    target_logits: torch.Tensor,
    target_rows: torch.Tensor,
    row_weights: torch.Tensor,
    chunk_fn: Callable = soft_ce_chunk,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`RowsFn` in torch: the target rows gathered, `chunk_fn` (soft_ce_chunk, or its compiled version),
    its gradient copied over the logits."""
    targets = target_logits.index_select(0, target_rows)  # [C, Vd]
    row_loss, grad_logits, top1 = chunk_fn(logits, targets, row_weights)
    logits.copy_(grad_logits)
    return row_loss, top1


def compiled_rows_fn() -> RowsFn:
    """`soft_ce_rows` around the torch.compile'd chunk (inductor)."""
    compiled = torch.compile(soft_ce_chunk, dynamic=True)
    return lambda logits, target_logits, target_rows, row_weights: soft_ce_rows(
        logits, target_logits, target_rows, row_weights, compiled
    )


def triton_rows_fn() -> RowsFn:
    """The hand-written Triton kernel (GPU only)."""
    from eagle3_core.training.soft_ce_triton import soft_ce_rows_triton

    return soft_ce_rows_triton


class _FusedSoftCrossEntropy(torch.autograd.Function):
    """sum_n row_weight[n] * CE(softmax(target[n]), log_softmax(hidden[n] @ weight.T)), plus each row's
    weighted CE and the draft's argmax (no gradient). Forward keeps d loss / d logits (compute dtype)
    instead of the logits (each chunk's logits GEMM writes into that buffer, `rows_fn` overwrites them);
    backward is two matmuls whose (small) outputs take the incoming scale, so the [N, Vd] gradient is never
    rewritten. `target_rows` [N] picks each row's target from `target_logits` (no [N, Vd] gathered copy)."""

    @staticmethod
    def forward(ctx, hidden, weight, weight_c, target_logits, target_rows, row_weights, chunk, rows_fn):
        hidden_c = hidden.to(weight_c.dtype)  # [N, H]
        grad_logits = torch.empty(hidden.shape[0], weight_c.shape[0], dtype=weight_c.dtype, device=hidden.device)
        accumulate = torch.promote_types(target_logits.dtype, torch.float32)
        row_loss = torch.empty(hidden.shape[0], dtype=accumulate, device=hidden.device)
        draft_top1 = torch.empty(hidden.shape[0], dtype=torch.long, device=hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, hidden.shape[0], chunk):
                rows = slice(start, start + chunk)
                logits = torch.mm(hidden_c[rows], weight_c.T, out=grad_logits[rows])  # [C, Vd]
                row_loss[rows], draft_top1[rows] = rows_fn(logits, target_logits, target_rows[rows], row_weights[rows])
        ctx.save_for_backward(hidden_c, weight_c, grad_logits)
        ctx.dtypes = (hidden.dtype, weight.dtype)
        ctx.mark_non_differentiable(row_loss, draft_top1)
        return row_loss.sum(), row_loss, draft_top1

    @staticmethod
    def backward(ctx, grad_loss, _grad_rows, _grad_top1):
        hidden_c, weight_c, grad_logits = ctx.saved_tensors
        hidden_dtype, weight_dtype = ctx.dtypes
        grad_weight = None
        with torch.autocast(hidden_c.device.type, enabled=False):
            grad_hidden = (grad_logits @ weight_c).to(hidden_dtype) * grad_loss.to(hidden_dtype)  # [N, H]
            if ctx.needs_input_grad[1]:  # not with a frozen lm_head (training.freeze_lm_head)
                grad_weight = (grad_logits.T @ hidden_c).to(weight_dtype) * grad_loss.to(weight_dtype)  # [Vd, H]
        return grad_hidden, grad_weight, None, None, None, None, None, None


def fused_soft_cross_entropy_rows(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target_logits: torch.Tensor,
    row_weights: torch.Tensor,
    target_rows: torch.Tensor | None = None,
    weight_c: torch.Tensor | None = None,
    chunk: int = LOSS_CHUNK_ROWS,
    rows_fn: RowsFn = soft_ce_rows,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden [N, H] (normed draft states), weight [Vd, H] (lm_head, gets the gradient), target_logits
    [M, Vd] with target_rows [N] (row n is scored against target_logits[target_rows[n]]; None: M = N, in
    order), row_weights [N] -> (weighted loss sum, weighted CE per row [N], draft argmax [N]). `weight_c` is
    the weight in the compute dtype (bf16 on GPU), cast once per batch by the caller; `rows_fn` the
    soft-CE row function (`RowsFn`)."""
    weight_c = weight.detach() if weight_c is None else weight_c
    if target_rows is None:
        target_rows = torch.arange(hidden.shape[0], device=hidden.device)
    return _FusedSoftCrossEntropy.apply(
        hidden, weight, weight_c, target_logits, target_rows, row_weights, chunk, rows_fn
    )


def step_valid(loss_mask: torch.Tensor, document_ids: torch.Tensor, step: int) -> torch.Tensor:
    """[B, T] bool: draft step `step` at index i is scored iff token i+step+2 exists, is loss-masked and is
    in the same document as i (a chain never crosses into the next packed sample)."""
    shift = step + 2
    valid = torch.zeros_like(loss_mask, dtype=torch.bool)
    if shift < loss_mask.shape[1]:
        same_document = document_ids[:, shift:] == document_ids[:, :-shift]
        valid[:, :-shift] = loss_mask[:, shift:].bool() & same_document
    return valid


def scored_rows(
    loss_mask: torch.Tensor, document_ids: torch.Tensor, ttt_steps: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """loss_mask, document_ids [B, T] -> (valid [K, B, T] bool (`step_valid` of every step), its nonzero
    indices [N, 3] = (step, b, i), ordered by step). The data loader computes them on the CPU (`collate`),
    so the training step never waits for the GPU to learn N (a host sync per step otherwise)."""
    valid = torch.stack([step_valid(loss_mask, document_ids, step) for step in range(ttt_steps)])  # [K, B, T]
    return valid, valid.nonzero()


@dataclass
class TargetHead:
    """The target's final norm (None when states are stored normed) and lm_head rows of the draft
    vocabulary; `full_weight` (the whole lm_head) is kept for validation's exact top-1 only."""

    weight: torch.Tensor  # [Vd, H]
    norm_weight: torch.Tensor | None  # [H]
    eps: float
    d2t: torch.Tensor  # [Vd]
    full_weight: torch.Tensor | None = None  # [V, H]
    t2d: torch.Tensor | None = None  # [V] bool: target ids in the draft vocabulary

    @classmethod
    def from_target(
        cls, target_dir: Path | str, t2d: torch.Tensor, d2t: torch.Tensor, last_state_normed: bool, eps: float
    ) -> TargetHead:
        from eagle3_core.target.models import load_target_tensors

        tensors = load_target_tensors(target_dir, ["norm", "lm_head"])
        norm = None if last_state_normed else tensors["norm"]
        return cls(tensors["lm_head"][t2d].contiguous(), norm, eps, d2t, tensors["lm_head"], t2d.bool())

    def to(self, device: torch.device | str, dtype: torch.dtype) -> TargetHead:
        move = lambda t: None if t is None else t.to(device=device, dtype=dtype)  # noqa: E731
        t2d = None if self.t2d is None else self.t2d.to(device)
        return TargetHead(
            move(self.weight), move(self.norm_weight), self.eps, self.d2t.to(device), move(self.full_weight), t2d
        )

    def normed(self, last: torch.Tensor) -> torch.Tensor:
        if self.norm_weight is None:
            return last
        x = last.float()
        return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)).to(last.dtype) * self.norm_weight

    @torch.no_grad()
    def logits(self, last: torch.Tensor) -> torch.Tensor:
        """last [B, T, H] -> draft-vocabulary logits [B, T, Vd] (in the head's dtype)."""
        return self.normed(last.to(self.weight.dtype)) @ self.weight.T

    @torch.no_grad()
    def full_top1(self, last: torch.Tensor, chunk: int = LOSS_CHUNK_ROWS) -> torch.Tensor:
        """Target ids of the target's greedy token at every row, over its whole vocabulary: [B, T]."""
        if self.full_weight is None:
            return self.draft_to_target(self.logits(last).argmax(-1))
        flat = self.normed(last.to(self.full_weight.dtype)).flatten(0, 1)
        top1 = torch.cat([(flat[s : s + chunk] @ self.full_weight.T).argmax(-1) for s in range(0, len(flat), chunk)])
        return top1.view(last.shape[:2])

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def in_draft_vocab(self, target_top1: torch.Tensor) -> torch.Tensor:
        """Target ids (`full_top1`) -> bool: inside the draft vocabulary."""
        if self.t2d is None:
            raise ValueError("masking out-of-vocabulary positions needs the head's t2d")
        return self.t2d[target_top1]


class TTTObjective(nn.Module):
    """Draft + loss in one module, so DDP/FSDP wrap a single forward that returns the loss.

    forward(batch) -> (loss, stats [K, 3] = per step: unweighted CE sum, top-1 agreements, scored tokens;
    agree [K, B, T] and valid [K, B, T] for the acceptance simulation)."""

    def __init__(
        self,
        draft: Eagle3Draft,
        ttt_steps: int,
        step_weight: float,
        attention: str = "auto",
        mask_out_of_vocab: bool = False,
        target_temperature: float = 1.0,
    ):
        super().__init__()
        self.draft, self.ttt_steps, self.step_weight, self.attention = draft, ttt_steps, step_weight, attention
        self.target_temperature = target_temperature  # the scored distribution: softmax(target logits / this)
        # Positions whose target argmax (whole vocabulary) the draft cannot emit weigh 0 in the loss; the
        # top-1 / acceptance statistics still count them (decoding meets them too).
        self.mask_out_of_vocab = mask_out_of_vocab
        self.rows_fn: RowsFn = soft_ce_rows
        self._step_weights: dict[tuple[int, torch.device, torch.dtype], torch.Tensor] = {}
        # The unroll's options (`unroll.ttt_states`): DDP's early gradient sync (`distributed.wrap` sets
        # it) and the deferred weight gradients (off only to time autograd's sum).
        self.gradient_sync: GradientSync | None = None
        self.defer_weight_gradients = True

    def compile(self, loss_kernel: str = "triton") -> None:  # type: ignore[override]
        """GPU: torch.compile the draft's dense blocks (flex attention is always compiled) and run the
        soft-CE rows through `loss_kernel`: "triton" (the hand-written kernel) or "inductor" (the
        torch.compile'd chunk)."""
        self.draft.compile_blocks()
        self.rows_fn = triton_rows_fn() if loss_kernel == "triton" else compiled_rows_fn()

    def attention_backend(self, device: torch.device) -> str:
        """`attention`, with auto resolved: eager on a CPU; on a GPU flash, or flex for the MLA draft (its
        values are narrower than its keys, which FlashAttention-2 does not take)."""
        if self.attention != "auto":
            return self.attention
        if device.type != "cuda":
            return "eager"
        return "flex" if self.draft.config.architecture == "deepseek_mla" else "flash"

    def step_weights(self, steps: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """[K] step_weight**k, made once per device (a tensor built from a list is a host-synchronous copy)."""
        key = (steps, device, dtype)
        if key not in self._step_weights:
            weights = [self.step_weight**k for k in range(steps)]
            self._step_weights[key] = torch.tensor(weights, dtype=dtype, device=device)
        return self._step_weights[key]

    def forward(self, batch: dict[str, torch.Tensor], head: TargetHead, exact_top1: bool = False):
        """batch: `collate`'s tensors, with `valid` / `scored` (`scored_rows`) when the loader made them."""
        attend = TTTAttention.for_documents(
            batch["document_ids"], self.attention_backend(batch["document_ids"].device), batch.get("document_starts")
        )
        states = ttt_states(
            self.draft,
            batch["aux"],
            batch["input_ids"],
            batch["position_ids"],
            attend,
            self.ttt_steps,
            self.gradient_sync,
            self.defer_weight_gradients,
        )  # K x [B, T, H]
        target_logits = head.logits(batch["last"])  # [B, T, Vd], once per batch, shared by every step
        exact = exact_top1 or self.mask_out_of_vocab
        target_top1 = head.full_top1(batch["last"]) if exact else head.draft_to_target(target_logits.argmax(-1))
        lm_head = self.draft.lm_head.weight
        weight_c = lm_head.detach().to(torch.bfloat16 if lm_head.is_cuda else lm_head.dtype)
        if "scored" in batch:  # made by the loader
            valid, scored = batch["valid"], batch["scored"]  # [K, B, T], [N, 3]
            if valid.shape[0] != len(states):
                raise ValueError(f"batch scored for {valid.shape[0]} TTT steps, objective has {len(states)}")
        else:  # one host sync (the number of scored rows)
            valid, scored = scored_rows(batch["loss_mask"], batch["document_ids"], len(states))
        counts = valid.sum((1, 2))  # [K]
        # All steps' scored rows in ONE loss call: one lm_head weight-gradient GEMM (and one fp32 cast of
        # it) per batch instead of one per step.
        step, b, i = scored.unbind(1)  # [N] each, ordered by step
        batch_size, length = valid.shape[1:]
        flat = b * length + i  # row index in [B*T]; index_select copies whole rows (fast gather)
        all_states = torch.cat([state.reshape(batch_size * length, -1) for state in states])  # [K*B*T, H]
        hidden = self.draft.norm(all_states.index_select(0, step * (batch_size * length) + flat))  # [N, H]
        step_weights = self.step_weights(len(states), hidden.device, hidden.dtype)  # [K]
        target_rows = flat + step + 1  # [N]
        if self.mask_out_of_vocab:  # weight 0 where the target's argmax is outside the draft vocabulary
            keep = head.in_draft_vocab(target_top1).view(-1)[target_rows].to(hidden.dtype)  # [N]
            kept = torch.zeros(len(states), dtype=hidden.dtype, device=hidden.device).index_add_(0, step, keep)
            row_weights = (step_weights / kept.clamp(min=1))[step] * keep
        else:
            row_weights = (step_weights / counts.clamp(min=1))[step]
        flat_logits = target_logits.view(batch_size * length, -1)  # [B*T, Vd]
        if self.target_temperature != 1.0:  # in place, after the argmax above: top-1 stays the target's own
            flat_logits.div_(self.target_temperature)  # no second [B*T, Vd] buffer per batch
        loss, row_loss, draft_top1 = fused_soft_cross_entropy_rows(
            hidden, lm_head, flat_logits, row_weights, target_rows, weight_c, rows_fn=self.rows_fn
        )
        agree = torch.zeros_like(valid)
        agree[step, b, i] = self.draft.draft_to_target(draft_top1) == target_top1[b, i + step + 1]
        step_loss = torch.zeros(len(states), dtype=row_loss.dtype, device=row_loss.device).index_add_(
            0, step, row_loss
        )  # [K] weighted
        unweighted = step_loss * counts.clamp(min=1) / step_weights.to(step_loss.dtype)
        stats = torch.stack([unweighted, agree.sum((1, 2)).float(), counts.float()], dim=1)  # [K, 3]
        return loss, stats, agree, valid


def acceptance_counts(agree: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Greedy chain acceptance from per-step top-1 agreement (teacher-forced inputs equal the greedy
    chain's while every earlier token was accepted). agree/valid [K, ...] -> (chains accepting positions
    0..k, for each k: [K] long; chains counted). Chains start where step 0 is scored and stop where the
    sample ends; sum the counts over batches, then `acceptance_summary`."""
    chains = valid[0]
    accepted_prefix = torch.cumprod((agree & valid).long(), dim=0)[:, chains]  # [K, chains]
    return accepted_prefix.sum(-1).cpu(), int(chains.sum())


def response_spans(starts: list[bool]) -> list[tuple[int, int]]:
    """Maximal runs [begin, end) of True in one row of `valid[0]`: one response each (the loss mask's
    assistant span, cut at packed-document boundaries by `step_valid`)."""
    spans, begin = [], None
    for i, ok in enumerate([*starts, False]):
        if ok and begin is None:
            begin = i
        elif not ok and begin is not None:
            spans.append((begin, i))
            begin = None
    return spans


def decoding_counts(agree: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Greedy chain acceptance as a decode of each response meets it, not at every position.

    `acceptance_counts` starts a chain at every scored index, so an easy stretch of n tokens counts n times;
    a decode accepts it in one round and spends most of its rounds where the draft fails, which is why
    served acceptance sits below that average. This walks each response as the served engine does: the
    target makes the response's first token itself, so the first round starts at the index after the span's
    first; a round at index i accepts the j leading agreeing steps and the target adds one token, so the
    next round starts at i + j + 1. With greedy responses the teacher-forced inputs are the decode's own.
    agree/valid [K, B, T] -> (rounds accepting positions 0..k, for each k: [K] long; rounds)."""
    steps = agree.shape[0]
    leading = torch.cumprod((agree & valid).long(), dim=0).sum(0).cpu()  # [B, T] draft tokens accepted at i
    counts, rounds = [0] * (steps + 1), 0
    for row, starts in zip(leading.tolist(), valid[0].cpu().tolist(), strict=True):
        for begin, end in response_spans(starts):
            i = begin + 1
            while i < end:
                counts[row[i]] += 1
                rounds += 1
                i += row[i] + 1
    at_least = torch.tensor(counts).flip(0).cumsum(0).flip(0)[1:]  # [K]: rounds accepting >= k+1 tokens
    return at_least, rounds


def acceptance_summary(accepted: torch.Tensor, chains: int) -> tuple[float, list[float]]:
    """(simulated acceptance length 1 + E[accepted tokens], per-position acceptance rates) as vLLM
    reports them: position k counts chains whose first k+1 draft tokens were all accepted."""
    if chains == 0:
        return 1.0, [0.0] * len(accepted)
    per_position = [count / chains for count in accepted.tolist()]
    return 1.0 + sum(per_position), per_position
