"""The optimizer of `training.optimizer`: AdamW on everything, or Muon on the 2-D weights with AdamW on the
rest, as one `torch.optim.Optimizer` (so the lr scheduler, gradient clipping and the resumable state
see one object).

Muon is `torch.optim.Muon` (PyTorch >= 2.9) with `adjust_lr_fn="match_rms_adamw"`: its update is scaled to
AdamW's RMS, so both halves share one learning rate and one schedule. It takes the trainable 2-D weights
of `fc` and the decoder layer; `lm_head` (an output layer) and every 1-D norm weight stay on AdamW.
`torch.optim.Muon` orthogonalises in bfloat16, which a CPU without bf16 units emulates about 10x slower
than float32 (95 s against 10 s a step for SmolLM2's eight matrices, measured on this AVX2 machine), so
`NewtonSchulzMuon` runs the same iteration in the `auto` compute dtype of the device: bfloat16 on CUDA and
bf16 CPUs, float32 elsewhere. For long matrices (n >= 3m: the layer's gate/up/down, fc, k/v) it runs the
iteration's restarted Gram form (`gram_newton_schulz`: the same polynomial, equal to float64 rounding,
~30 % fewer FLOPs; its bfloat16 rounding error is close to the standard form's own, bench/RESULTS.md), the
other matrices bit for bit torch's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from eagle3_core.dtypes import resolve_dtype

if TYPE_CHECKING:  # the config needs pydantic; the optimizers themselves need only torch
    from eagle3_core.config import TrainingConfig

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's quintic Newton-Schulz
NS_STEPS = 5
NS_EPS = 1e-7
GRAM_MIN_ASPECT = 3  # n / m from which the Gram form of the iteration runs (fewer FLOPs from n > 1.5 m)
GRAM_RESTART = (2, NS_STEPS - 2)  # the Gram form's NS_STEPS in blocks, each from a freshly formed X

BETAS = (0.9, 0.95)
ADAMW_ONLY = ("lm_head.weight",)


def muon_parameters(module: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(Muon's, AdamW's) trainable parameters: Muon takes every 2-D weight but `lm_head`."""
    muon, adamw = [], []
    for name, param in module.named_parameters():
        if not param.requires_grad:
            continue
        (muon if param.ndim == 2 and not name.endswith(ADAMW_ONLY) else adamw).append(param)
    return muon, adamw


def oriented(matrix: torch.Tensor) -> torch.Tensor:
    """[A, B] -> the [min(A, B), max(A, B)] view Newton-Schulz works on (the transpose when A > B)."""
    return matrix.T if matrix.size(0) > matrix.size(1) else matrix


def same_shape_groups(matrices: list[torch.Tensor]) -> list[list[int]]:
    """Indices of `matrices` grouped by their oriented shape, groups and members in first-seen order."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for index, matrix in enumerate(matrices):
        groups.setdefault(tuple(oriented(matrix).shape), []).append(index)
    return list(groups.values())


def normalized(stacked: torch.Tensor) -> torch.Tensor:
    """stacked [N, m, n] -> each matrix divided by its Frobenius norm (so its spectral norm is at most 1)."""
    norms = torch.linalg.vector_norm(stacked, dim=(1, 2), keepdim=True)  # [N, 1, 1]
    return stacked / norms.clamp(min=NS_EPS)


def newton_schulz(stacked: torch.Tensor) -> torch.Tensor:
    """stacked [N, m, n] (m <= n) -> torch.optim.Muon's quintic Newton-Schulz iteration on each matrix, in
    stacked's dtype: X <- (a I + b R + c R^2) X with R = X X^T; per step 4 m^2 n + 2 m^3 FLOPs a matrix."""
    a, b, c = NS_COEFFICIENTS
    x = normalized(stacked)
    for _ in range(NS_STEPS):
        gram = torch.bmm(x, x.mT)  # [N, m, m]
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x


def gram_steps(x: torch.Tensor, steps: int) -> torch.Tensor:
    """x [N, m, n] -> `steps` Newton-Schulz steps through its Gram matrix: every X_k = Q_k X and
    R_k = X_k X_k^T are polynomials in R = X X^T (they commute), so only R and the final Q X touch the long
    side n; the steps in between are [m, m] products."""
    a, b, c = NS_COEFFICIENTS
    r = torch.bmm(x, x.mT)  # [N, m, m]
    q = None
    for step in range(steps):
        p = torch.baddbmm(r, r, r, beta=b, alpha=c)
        p.diagonal(dim1=1, dim2=2).add_(a)  # P = a I + b R + c R^2
        q = p if q is None else torch.bmm(p, q)
        if step < steps - 1:
            r = torch.bmm(p, torch.bmm(p, r))  # R_{k+1} = P R P^T = P^2 R
    return torch.bmm(q, x)


def gram_newton_schulz(stacked: torch.Tensor) -> torch.Tensor:
    """The same iteration as `newton_schulz`, in Gram form, restarted (X formed, R recomputed) after the
    GRAM_RESTART[0] first steps: 8 m^2 n + 28 m^3 FLOPs a matrix against 20 m^2 n + 10 m^3 (30 % fewer at
    n = 3.5 m). Without the restart, bf16 rounding of R is amplified by the small singular values' growth
    (~3.4x a step): on the GPU, a [4096, 14336] gradient with one dominant direction came out 4.4x its own
    norm off (the standard form: 0.070); restarted, 0.070 (bench/RESULTS.md, issue 19)."""
    x = normalized(stacked)  # [N, m, n]
    for steps in GRAM_RESTART:
        x = gram_steps(x, steps)
    return x


def orthogonalize_stacked(stacked: torch.Tensor) -> torch.Tensor:
    """stacked [N, m, n] (m <= n) -> each matrix's nearest semi-orthogonal matrix, approximately: the
    Newton-Schulz iteration in stacked's dtype, through the Gram matrix where n >= GRAM_MIN_ASPECT * m."""
    _, m, n = stacked.shape
    return gram_newton_schulz(stacked) if n >= GRAM_MIN_ASPECT * m else newton_schulz(stacked)


def match_rms_adamw_lr(lr: float, shape: torch.Size) -> float:
    """torch.optim.Muon's `match_rms_adamw` learning rate of a matrix of `shape`."""
    return lr * 0.2 * max(shape[:2]) ** 0.5


class NewtonSchulzMuon(torch.optim.Muon):
    """`torch.optim.Muon` (nesterov momentum, `match_rms_adamw` lr) whose Newton-Schulz runs in `ns_dtype`;
    the state (`momentum_buffer`) and groups are torch's, so checkpoints load into either. The momentum and
    weight decay of all matrices are foreach ops, and same-shape matrices (gate/up/down, k/v) are
    orthogonalised together, as one stack: a few large launches a step instead of ~20 per matrix."""

    def __init__(self, params: list[nn.Parameter], lr: float, weight_decay: float, ns_dtype: torch.dtype):
        super().__init__(params, lr=lr, weight_decay=weight_decay, adjust_lr_fn="match_rms_adamw")
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            lr, momentum = group["lr"], group["momentum"]
            grads = [p.grad for p in params]
            buffers = [self.state[p].setdefault("momentum_buffer", torch.zeros_like(p.grad)) for p in params]
            torch._foreach_lerp_(buffers, grads, 1 - momentum)
            updates = torch._foreach_lerp(grads, buffers, momentum) if group["nesterov"] else buffers
            torch._foreach_mul_(params, 1 - lr * group["weight_decay"])
            for indices in same_shape_groups(updates):
                first = oriented(updates[indices[0]])
                stacked = first.new_empty((len(indices), *first.shape), dtype=self.ns_dtype)  # [N, min, max]
                for row, index in zip(stacked, indices, strict=True):
                    row.copy_(oriented(updates[index]))
                for row, index in zip(orthogonalize_stacked(stacked), indices, strict=True):
                    oriented(params[index]).add_(row, alpha=-match_rms_adamw_lr(lr, params[index].shape))


class MuonAdamW(torch.optim.Optimizer):
    """Muon on `muon_params`, AdamW on `adamw_params`: param group 0 is Muon's, group 1 AdamW's. The two
    inner optimizers share this object's groups and state, so `state_dict`, `load_state_dict` and the lr
    scheduler (which sets `lr` in every group) act on both."""

    def __init__(
        self,
        muon_params: list[nn.Parameter],
        adamw_params: list[nn.Parameter],
        lr: float,
        muon_weight_decay: float,
        adamw_weight_decay: float,
        fused: bool = False,
        ns_dtype: torch.dtype = torch.bfloat16,
    ):
        if not hasattr(torch.optim, "Muon"):
            raise RuntimeError(
                f"training.optimizer=muon needs torch.optim.Muon (PyTorch >= 2.9), not {torch.__version__}"
            )
        self.muon = NewtonSchulzMuon(muon_params, lr, muon_weight_decay, ns_dtype)
        self.adamw = torch.optim.AdamW(
            adamw_params, lr=lr, betas=BETAS, weight_decay=adamw_weight_decay, fused=fused or None
        )
        groups = [self.muon.param_groups[0], self.adamw.param_groups[0]]
        super().__init__(groups, {"lr": lr})
        self._link()

    def _link(self) -> None:
        """Point the inner optimizers at this object's groups and state (after construction and after
        `load_state_dict`, which replaces both)."""
        self.muon.param_groups, self.adamw.param_groups = [self.param_groups[0]], [self.param_groups[1]]
        self.muon.state = self.adamw.state = self.state

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._link()

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.muon.step()
        self.adamw.step()
        return loss


def build_optimizer(module: nn.Module, tc: TrainingConfig, device: torch.device) -> torch.optim.Optimizer:
    """`training.optimizer` over the trainable parameters of `module` (fused AdamW on CUDA)."""
    fused = device.type == "cuda"
    if tc.optimizer == "muon":
        muon, adamw = muon_parameters(module)
        if any(type(p).__name__ == "DTensor" for p in muon):  # FSDP2 shards: Newton-Schulz needs whole matrices
            raise ValueError("training.optimizer=muon needs whole weight matrices: use training.sharding=ddp or adamw")
        ns_dtype = getattr(torch, resolve_dtype("auto", fused))  # float32 on a CPU without bf16 units
        return MuonAdamW(muon, adamw, tc.lr, tc.muon_weight_decay, tc.weight_decay, fused=fused, ns_dtype=ns_dtype)
    params = [p for p in module.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=tc.lr, betas=BETAS, weight_decay=tc.weight_decay, fused=fused)
