"""InfoNCE: the contrastive loss of MoCo v3 (facebookresearch/moco-v3 moco/builder.py `contrastive_loss`).

Queries and keys are L2-normalised; query i's positive is key i of this process, every other key of every process is
a negative; the cross-entropy of the similarity logits / T is multiplied by 2T, as the official code does:

    loss = CE(q_BD @ k_MD.T / T, arange(B) + offset) * 2T

Keys come from all processes through `gather_keys` (injected by the caller, the identity by default), so the loss
runs with no process group and never imports torch.distributed.

Shape legend: B queries (this process), M keys (all processes), D projection width.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from trainlab.dtypes import at_least_float32

GatherKeys = Callable[[torch.Tensor], tuple[torch.Tensor, int]]
"""keys (B, D) of this process -> (keys of every process (M, D), index of this process's first key in them)."""


def local_keys(k_BD: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The single-process `GatherKeys`: the keys themselves, offset 0."""
    return k_BD, 0


def infonce_loss(
    q_BD: torch.Tensor, k_BD: torch.Tensor, temperature: float, gather_keys: GatherKeys = local_keys
) -> torch.Tensor:
    """InfoNCE of queries against all keys (the positive of query i is key i of this process), x 2T.

    Computed in fp32 (a no-op for fp32 inputs, so it equals the official formula there).
    """
    q_BD = F.normalize(at_least_float32(q_BD), dim=1)
    k_BD = F.normalize(at_least_float32(k_BD), dim=1)
    k_MD, offset = gather_keys(k_BD)
    logits_BM = torch.einsum("nc,mc->nm", q_BD, k_MD) / temperature
    labels_B = torch.arange(q_BD.shape[0], dtype=torch.long, device=q_BD.device) + offset
    return F.cross_entropy(logits_BM, labels_B) * (2 * temperature)
