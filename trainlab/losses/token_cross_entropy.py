"""VAR's training loss and metrics on token logits: per-token cross-entropy weighted per position, the official
mean / last-scale / per-scale loss and accuracy.

`token_cross_entropy` is what `trainlab train var` optimises: sum_l w_l CE(logits_l, target_l), mean over the batch.
It computes the loss, its gradient with respect to the logits and each row's argmax (for the accuracy metrics) in
the forward pass, in four passes over the (B, L, V) logits; backward only scales the stored gradient. The
`F.cross_entropy` route takes about eight (log-softmax, gather, a zero-filled one-hot-sized gradient, the log-softmax
backward, and a separate argmax for the metrics). Same value and gradient up to float rounding (tests compare both).

Shapes: B batch, L tokens of all scales, V vocabulary, N = B x L rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from trainlab.dtypes import at_least_float32


@dataclass
class TokenLoss:
    """`loss`: the differentiable training objective (scalar); `ce_BL`: the unsmoothed per-token cross-entropy and
    `prediction_BL`: the argmax token, both without gradient (for the metrics)."""

    loss: torch.Tensor
    ce_BL: torch.Tensor
    prediction_BL: torch.Tensor


class _FusedTokenCrossEntropy(torch.autograd.Function):
    """sum_n w_n CE_n (label smoothing s) with its gradient w_n (softmax_n - (1 - s) onehot_n - s / V) computed in
    the forward pass and stored in place of the log-probabilities; backward multiplies it by the incoming scalar."""

    @staticmethod
    def forward(
        ctx: Any, logits_NV: torch.Tensor, target_N: torch.Tensor, weight_N: torch.Tensor, smoothing: float
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        V = logits_NV.shape[1]
        target_N1, weight_N1 = target_N.unsqueeze(1), weight_N.unsqueeze(1)
        max_N1, prediction_N1 = logits_NV.max(dim=1, keepdim=True)
        grad_NV = logits_NV.sub(max_N1).exp_()
        sumexp_N1 = grad_NV.sum(dim=1, keepdim=True)
        lse_N1 = sumexp_N1.log().add_(max_N1)
        ce_N = (lse_N1 - logits_NV.gather(1, target_N1)).squeeze(1)
        train_ce_N = ce_N
        if smoothing > 0.0:
            train_ce_N = (1.0 - smoothing) * ce_N + smoothing * (lse_N1.squeeze(1) - logits_NV.mean(dim=1))
        loss = (train_ce_N * weight_N).sum()
        grad_NV.mul_(weight_N1 / sumexp_N1)  # w * softmax
        if smoothing > 0.0:
            grad_NV.sub_(weight_N1 * (smoothing / V))
        grad_NV.scatter_add_(1, target_N1, weight_N1 * (smoothing - 1.0))
        ctx.save_for_backward(grad_NV)
        ctx.used = False
        ctx.mark_non_differentiable(ce_N, prediction_N1)
        return loss, ce_N, prediction_N1.squeeze(1)

    @staticmethod
    def backward(
        ctx: Any, grad_loss: torch.Tensor, _grad_ce: Any, _grad_prediction: Any
    ) -> tuple[torch.Tensor, None, None, None]:
        if ctx.used:
            raise RuntimeError("token_cross_entropy scales its stored gradient in place: backward runs only once")
        ctx.used = True
        (grad_NV,) = ctx.saved_tensors
        return grad_NV.mul_(grad_loss), None, None, None


def token_cross_entropy(
    logits_BLV: torch.Tensor, target_BL: torch.Tensor, weight_L: torch.Tensor, label_smoothing: float = 0.0
) -> TokenLoss:
    """The VAR training loss sum_l w_l CE(logits_l, target_l), mean over the batch, with the metrics' inputs.

    Args:
        logits_BLV: logits (computed in float32; other dtypes are upcast).
        target_BL: target token ids.
        weight_L: per-position loss weights (1/L officially; progressive training ramps the newest scale).
        label_smoothing: torch's definition; the returned `ce_BL` is always unsmoothed (the official log).
    """
    B, L, V = logits_BLV.shape
    weight_N = (at_least_float32(weight_L) / B).repeat(B)
    loss, ce_N, prediction_N = _FusedTokenCrossEntropy.apply(
        at_least_float32(logits_BLV.reshape(B * L, V)), target_BL.reshape(B * L), weight_N, float(label_smoothing)
    )
    return TokenLoss(loss=loss, ce_BL=ce_N.view(B, L), prediction_BL=prediction_N.view(B, L))


@torch.no_grad()
def token_metrics(
    ce_BL: torch.Tensor,
    prediction_BL: torch.Tensor,
    target_BL: torch.Tensor,
    slices: Sequence[slice],
    *,
    all_scales: bool,
    per_scale: bool,
) -> dict[str, torch.Tensor]:
    """Mean, last-scale (when `all_scales`) and optionally per-scale unsmoothed cross-entropy and token accuracy.

    `slices` covers exactly the positions in `prediction_BL`: fewer scales during progressive training, where no
    last-scale metric is reported (`all_scales` False), as in the official code.
    """
    ce_BL = at_least_float32(ce_BL.detach())
    correct_BL = (prediction_BL == target_BL).float()
    out = {"cross_entropy_mean": ce_BL.mean(), "token_accuracy_mean": correct_BL.mean()}
    if all_scales:
        out["cross_entropy_last_scale"] = ce_BL[:, slices[-1]].mean()
        out["token_accuracy_last_scale"] = correct_BL[:, slices[-1]].mean()
    if per_scale:
        for k, sl in enumerate(slices):
            out[f"cross_entropy_scale_{k}"] = ce_BL[:, sl].mean()
            out[f"token_accuracy_scale_{k}"] = correct_BL[:, sl].mean()
    return out


class TokenMetricTotals:
    """Cross-entropy and token accuracy summed per scale over many batches (evaluation), in float64.

    `metrics()` gives the means over all tokens, of the last scale and of each scale, like the training metrics.
    """

    def __init__(self, slices: Sequence[slice], device: torch.device) -> None:
        self.slices = list(slices)
        self.ce_sum_K = torch.zeros(len(self.slices), dtype=torch.float64, device=device)
        self.correct_K = torch.zeros(len(self.slices), dtype=torch.float64, device=device)
        self.images = 0

    def add(self, logits_BLV: torch.Tensor, target_BL: torch.Tensor) -> None:
        B, L, V = logits_BLV.shape
        ce_BL = F.cross_entropy(at_least_float32(logits_BLV).view(-1, V), target_BL.reshape(-1), reduction="none").view(
            B, L
        )
        correct_BL = (logits_BLV.argmax(-1) == target_BL).double()
        for k, sl in enumerate(self.slices):
            self.ce_sum_K[k] += ce_BL[:, sl].double().sum()
            self.correct_K[k] += correct_BL[:, sl].sum()
        self.images += B

    def metrics(self, prefix: str = "") -> dict[str, float]:
        """{} before any batch; else mean / last-scale / per-scale cross-entropy and accuracy, and the image count."""
        if self.images == 0:
            return {}
        tokens_K = torch.tensor(
            [self.images * (s.stop - s.start) for s in self.slices], dtype=torch.float64, device=self.ce_sum_K.device
        )
        ce_K, correct_K = self.ce_sum_K, self.correct_K
        out = {
            f"{prefix}cross_entropy_mean": float(ce_K.sum() / tokens_K.sum()),
            f"{prefix}cross_entropy_last_scale": float(ce_K[-1] / tokens_K[-1]),
            f"{prefix}token_accuracy_mean": float(correct_K.sum() / tokens_K.sum()),
            f"{prefix}token_accuracy_last_scale": float(correct_K[-1] / tokens_K[-1]),
            f"{prefix}images": float(self.images),
        }
        for k in range(len(self.slices)):
            out[f"{prefix}cross_entropy_scale_{k}"] = float(ce_K[k] / tokens_K[k])
            out[f"{prefix}token_accuracy_scale_{k}"] = float(correct_K[k] / tokens_K[k])
        return out
