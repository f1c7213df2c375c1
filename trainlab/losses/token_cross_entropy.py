"""VAR's training loss and metrics on token logits: per-token cross-entropy weighted per position, the official
mean / last-scale / per-scale loss and accuracy.

`weighted_token_cross_entropy` is what `trainlab train var` optimises. `token_loss` is the same value and gradient
in one less pass over the (B, L, V) logits (a custom autograd function; equal up to float rounding).

Shapes: B batch, L tokens of all scales, V vocabulary, N = B x L rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F


def weighted_token_cross_entropy(
    logits_BLV: torch.Tensor, target_BL: torch.Tensor, weight_L: torch.Tensor, label_smoothing: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The VAR training loss sum_l w_l CE(logits_l, target_l), mean over the batch, and the unsmoothed CE (B, L).

    With `label_smoothing` > 0 the loss is label-smoothed (torch's definition) and the returned CE is not: the
    official code logs the plain CE.
    """
    B, L, V = logits_BLV.shape
    ce_BL = F.cross_entropy(logits_BLV.view(-1, V), target_BL.reshape(-1), reduction="none").view(B, L)
    if label_smoothing > 0:
        train_ce_BL = F.cross_entropy(
            logits_BLV.view(-1, V), target_BL.reshape(-1), label_smoothing=label_smoothing, reduction="none"
        ).view(B, L)
    else:
        train_ce_BL = ce_BL
    return train_ce_BL.mul(weight_L).sum(dim=-1).mean(), ce_BL


@torch.no_grad()
def token_metrics(
    ce_BL: torch.Tensor,
    logits_BLV: torch.Tensor,
    target_BL: torch.Tensor,
    slices: Sequence[slice],
    *,
    all_scales: bool,
    per_scale: bool,
) -> dict[str, torch.Tensor]:
    """Mean, last-scale (when `all_scales`) and optionally per-scale unsmoothed cross-entropy and token accuracy.

    `slices` covers exactly the positions in `logits_BLV`: fewer scales during progressive training, where no
    last-scale metric is reported (`all_scales` False), as in the official code.
    """
    ce_BL = ce_BL.detach().float()
    correct_BL = (logits_BLV.detach().argmax(dim=-1) == target_BL).float()
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
        ce_BL = F.cross_entropy(logits_BLV.float().view(-1, V), target_BL.reshape(-1), reduction="none").view(B, L)
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


class _TokenCrossEntropy(torch.autograd.Function):
    """sum_n w_n * CE_n with label smoothing, gradient (softmax - smoothed one-hot) * w computed in one pass over
    the logits (F.cross_entropy materialises log-probabilities and a one-hot-sized gradient on the way)."""

    @staticmethod
    def forward(
        ctx: Any, logits_NV: torch.Tensor, target_N: torch.Tensor, weight_N: torch.Tensor, smoothing: float
    ) -> torch.Tensor:
        lse_N1 = logits_NV.logsumexp(dim=-1, keepdim=True)
        ce_N = lse_N1.squeeze(1) - logits_NV.gather(1, target_N.unsqueeze(1)).squeeze(1)
        if smoothing > 0.0:
            ce_N = (1.0 - smoothing) * ce_N + smoothing * (lse_N1.squeeze(1) - logits_NV.mean(dim=-1))
        ctx.save_for_backward(logits_NV, target_N, weight_N)
        ctx.smoothing = smoothing
        return (ce_N * weight_N).sum()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        logits_NV, target_N, weight_N = ctx.saved_tensors
        smoothing, V = ctx.smoothing, logits_NV.shape[1]
        gw_N1 = (grad * weight_N).unsqueeze(1)
        grad_NV = logits_NV.softmax(dim=-1)
        if smoothing > 0.0:
            grad_NV.sub_(smoothing / V)
        grad_NV.scatter_add_(1, target_N.unsqueeze(1), gw_N1.new_full(gw_N1.shape, smoothing - 1.0))
        return grad_NV.mul_(gw_N1), None, None, None


def token_loss(logits_BLV: torch.Tensor, target_BL: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
    """The official training loss: per-token cross-entropy (optional label smoothing), weight 1/L, summed over L,
    mean over the batch (= the mean token CE). Same value and gradient as `F.cross_entropy(..., reduction="none")`
    weighted that way, computed with one less pass over the (B, L, V) logits."""
    B, L, V = logits_BLV.shape
    weight_N = logits_BLV.new_full((B * L,), 1.0 / (L * B), dtype=torch.float32)
    logits_NV = logits_BLV.reshape(B * L, V).float()
    loss = _TokenCrossEntropy.apply(logits_NV, target_BL.reshape(B * L), weight_N, float(label_smoothing))
    assert isinstance(loss, torch.Tensor)
    return loss
