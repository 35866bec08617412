"""The optimizer of `training.optimizer`: AdamW on everything, or Muon on the 2-D weights with AdamW on the
rest, as one `torch.optim.Optimizer` (so the lr scheduler, gradient clipping and the resumable state
see one object).

Muon is `torch.optim.Muon` (PyTorch >= 2.9) with `adjust_lr_fn="match_rms_adamw"`: its update is scaled to
AdamW's RMS, so both halves share one learning rate and one schedule. It takes the trainable 2-D weights
of `fc` and the decoder layer; `lm_head` (an output layer) and every 1-D norm weight stay on AdamW.
"""

from __future__ import annotations

import torch
from torch import nn

from eagle3_core.config import TrainingConfig

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
    ):
        if not hasattr(torch.optim, "Muon"):
            raise RuntimeError(
                f"training.optimizer=muon needs torch.optim.Muon (PyTorch >= 2.9), not {torch.__version__}"
            )
        self.muon = torch.optim.Muon(muon_params, lr=lr, weight_decay=muon_weight_decay, adjust_lr_fn="match_rms_adamw")
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
        return MuonAdamW(muon, adamw, tc.lr, tc.muon_weight_decay, tc.weight_decay, fused=fused)
    params = [p for p in module.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=tc.lr, betas=BETAS, weight_decay=tc.weight_decay, fused=fused)
