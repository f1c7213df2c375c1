"""Full-batch keys: under gradient accumulation every query is scored against the keys of the whole optimizer batch.

The official code computes each step's loss over one batch of B queries and B keys (keys all-gathered over
processes). Accumulating k micro-batches of B/k with each micro-batch's own keys is a different loss: each query has
B/k - 1 negatives instead of B - 1. Here an optimizer step runs in two passes over the same micro-batches:

    1. keys: the momentum encoder (no gradient) on both views of every micro-batch, L2-normalised in fp32 as the
       loss normalises them, gathered over processes once: k1_MD, k2_MD with M = processes x k x B/k;
    2. queries: each micro-batch's queries with gradient against all M keys, the labels offset to the micro-batch's
       own keys (`MicroBatchKeys.loss`: the same `infonce_loss`, its gather returning the stored keys).

Each sample's keys are computed once, as in a single pass. The logits are then the large batch's, up to BatchNorm:
its statistics are those of each micro-batch here (of each process's batch without SyncBatchNorm), of the whole
global batch under the official SyncBatchNorm.

Shape legend: b micro-batch (per process), L keys of this process's micro-batches (k x b), M keys of all processes,
D projection width, C channels, H/W pixels.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from trainlab.dtypes import at_least_float32
from trainlab.losses.infonce import GatherKeys, infonce_loss, local_keys

MocoKeys = Literal["full-batch", "micro-batch"]
"""`--moco-keys`: what each query is scored against when the optimizer batch is split (micro-batches, processes)."""

__all__ = ["MicroBatchKeys", "MocoKeys", "OptimizerBatchKeys", "local_keys", "optimizer_batch_keys"]


@dataclass(frozen=True)
class MicroBatchKeys:
    """The optimizer batch's normalised keys and where one micro-batch's own keys sit in them.

    Attributes:
        k1_MD: view-1 keys of every micro-batch of every process (normalised, fp32 or wider, no gradient).
        k2_MD: the same for view 2.
        offset: index in M of this micro-batch's first key (its positives are keys offset .. offset + b - 1).
    """

    k1_MD: torch.Tensor
    k2_MD: torch.Tensor
    offset: int

    def loss(self, q1_bD: torch.Tensor, q2_bD: torch.Tensor, temperature: float) -> torch.Tensor:
        """ctr(q1, k2) + ctr(q2, k1) against all M keys: `MoCo.forward`'s loss with the optimizer batch's keys."""
        b = q1_bD.shape[0]
        own = slice(self.offset, self.offset + b)
        return infonce_loss(q1_bD, self.k2_MD[own], temperature, lambda _: (self.k2_MD, self.offset)) + (
            infonce_loss(q2_bD, self.k1_MD[own], temperature, lambda _: (self.k1_MD, self.offset))
        )


@dataclass(frozen=True)
class OptimizerBatchKeys:
    """The keys of one optimizer step (pass 1), handed out per micro-batch (pass 2).

    Attributes:
        k1_MD, k2_MD: as in `MicroBatchKeys`.
        offsets: index in M of each micro-batch's first key, in micro-step order.
    """

    k1_MD: torch.Tensor
    k2_MD: torch.Tensor
    offsets: tuple[int, ...]

    def of_micro_batch(self, micro_step: int) -> MicroBatchKeys:
        return MicroBatchKeys(self.k1_MD, self.k2_MD, self.offsets[micro_step])

    @property
    def nbytes(self) -> int:
        return self.k1_MD.nbytes + self.k2_MD.nbytes


def normalised_keys(momentum_encoder: nn.Module, x_BCHW: torch.Tensor) -> torch.Tensor:
    """Keys (B, D) of one view, normalised as `infonce_loss` normalises them (fp32 or wider)."""
    return F.normalize(at_least_float32(momentum_encoder(x_BCHW)), dim=1)


def optimizer_batch_keys(
    momentum_encoder: nn.Module, micro_batches: Iterable[tuple[torch.Tensor, torch.Tensor]], gather_keys: GatherKeys
) -> OptimizerBatchKeys:
    """Pass 1: the keys of every micro-batch (views 1 and 2), without gradient, gathered over processes once.

    `gather_keys` maps this process's L keys to (the M keys of all processes, index of this process's first key), as
    `trainlab.dist.gather_keys` does (every process holds the same number of keys).
    """
    k1s: list[torch.Tensor] = []
    k2s: list[torch.Tensor] = []
    with torch.no_grad():
        for x1_bCHW, x2_bCHW in micro_batches:
            k1s.append(normalised_keys(momentum_encoder, x1_bCHW))
            k2s.append(normalised_keys(momentum_encoder, x2_bCHW))
        k1_MD, start = gather_keys(torch.cat(k1s))
        k2_MD, start2 = gather_keys(torch.cat(k2s))
    assert start == start2, (start, start2)
    sizes = [k.shape[0] for k in k1s]
    offsets = tuple(start + sum(sizes[:i]) for i in range(len(sizes)))
    return OptimizerBatchKeys(k1_MD, k2_MD, offsets)
