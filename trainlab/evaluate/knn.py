"""Weighted kNN classification on frozen features (Wu et al. 2018, InstDisc; the monitor lightly and DINO use).

Cosine similarity between L2-normalised features; the k nearest bank samples vote for their class with weight
exp(similarity / T). MoCo v3 reports kNN curves but released no code (facebookresearch/moco-v3 issue 5); this
follows lightly's `knn_predict` (k=200, T=0.1). Shape legend: N queries, M bank samples, F feature width, K classes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from trainlab.dtypes import at_least_float32
from trainlab.errors import UsageError


def knn_predict(
    query_NF: torch.Tensor,
    bank_MF: torch.Tensor,
    bank_labels_M: torch.Tensor,
    *,
    num_classes: int,
    k: int = 200,
    temperature: float = 0.1,
    chunk: int = 1024,
    k_flag: str = "--knn-k",
) -> torch.Tensor:
    """Predicted labels (N,) by weighted cosine kNN (`k_flag`: how the command's user sets k, for the message).

    Raises:
        UsageError: `k` larger than the bank or not positive.
    """
    if not 0 < k <= bank_MF.shape[0]:
        raise UsageError(f"kNN k={k} must be between 1 and the bank size {bank_MF.shape[0]}; lower {k_flag}")
    bank_MF = F.normalize(at_least_float32(bank_MF), dim=1)
    preds = []
    for start in range(0, query_NF.shape[0], chunk):
        q_NF = F.normalize(at_least_float32(query_NF[start : start + chunk]), dim=1)
        sim_NM = q_NF @ bank_MF.T
        sim_Nk, idx_Nk = sim_NM.topk(k, dim=1)
        weight_Nk = (sim_Nk / temperature).exp()
        onehot_NkK = F.one_hot(bank_labels_M[idx_Nk], num_classes).float()
        scores_NK = (onehot_NkK * weight_Nk.unsqueeze(-1)).sum(dim=1)
        preds.append(scores_NK.argmax(dim=1))
    return torch.cat(preds)


def knn_accuracy(
    query_NF: torch.Tensor,
    query_labels_N: torch.Tensor,
    bank_MF: torch.Tensor,
    bank_labels_M: torch.Tensor,
    *,
    num_classes: int,
    k: int = 200,
    temperature: float = 0.1,
    k_flag: str = "--knn-k",
) -> float:
    """Top-1 accuracy of `knn_predict` on labelled queries."""
    pred_N = knn_predict(
        query_NF, bank_MF, bank_labels_M, num_classes=num_classes, k=k, temperature=temperature, k_flag=k_flag
    )
    return float((pred_N == query_labels_N.to(pred_N.device)).float().mean())
