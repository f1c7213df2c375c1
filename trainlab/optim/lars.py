"""LARS as in facebookresearch/moco-v3 moco/optimizer.py (You et al. 2017, https://arxiv.org/abs/1708.03888).

For a parameter with more than one dimension: add weight decay to the gradient, scale the update by the trust ratio
`trust_coefficient * ||p|| / ||update||` (1 when either norm is zero), then momentum SGD. Parameters with one
dimension or fewer (biases, BatchNorm gamma/beta) get neither weight decay nor the trust ratio: plain momentum SGD
at the group's learning rate. No learning-rate clipping (solo-learn's variant adds one; the official one does not).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch


class LARS(torch.optim.Optimizer):
    """The official MoCo v3 LARS.

    Args:
        params: parameters or parameter groups.
        lr: learning rate.
        weight_decay: L2 penalty added to the gradient of parameters with more than one dimension.
        momentum: momentum of the buffer `mu = momentum * mu + update`.
        trust_coefficient: eta of the trust ratio.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float,
        weight_decay: float = 0.0,
        momentum: float = 0.9,
        trust_coefficient: float = 0.001,
    ) -> None:
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, trust_coefficient=trust_coefficient)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                dp = p.grad
                if dp is None:
                    continue
                if p.ndim > 1:  # not a BatchNorm gamma/beta nor a bias
                    dp = dp.add(p, alpha=group["weight_decay"])
                    param_norm = torch.norm(p)
                    update_norm = torch.norm(dp)
                    one = torch.ones_like(param_norm)
                    q = torch.where(
                        param_norm > 0.0,
                        torch.where(update_norm > 0, (group["trust_coefficient"] * param_norm / update_norm), one),
                        one,
                    )
                    dp = dp.mul(q)
                state = self.state[p]
                if "mu" not in state:
                    state["mu"] = torch.zeros_like(p)
                mu = state["mu"]
                mu.mul_(group["momentum"]).add_(dp)
                p.add_(mu, alpha=-group["lr"])
        return loss
