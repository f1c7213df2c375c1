"""Codebook maintenance for the multi-scale quantizer, applied from outside `MultiScaleQuantizer`.

* `code_usage` / `usage_from_counts`: the one code-usage statistic (fraction used, perplexity, dead codes, per scale
  and pooled), of a batch of codes or of counts summed over a held-out set.
* `scale_residuals`: the vector each token was matched against (the area-pooled residual of its scale), recomputed
  through the quantizer's public `f_to_fhat_per_scale`.
* `EMACodebook`: the VQ-VAE-2 / Sonnet exponential-moving-average codebook update. Per code v:
  N_v <- d N_v + (1 - d) n_v,  m_v <- d m_v + (1 - d) sum(z assigned to v),  e_v = m_v / N~_v,
  with Laplace smoothing N~_v = (N_v + eps) / (sum N + V eps) * sum N. Codes never hit keep their vector (N_v and m_v
  decay together). State starts at N = 1, m = e (the current codebook).
* `DeadCodeTracker` + `restart_codes_`: codes not hit for `threshold` optimizer steps are re-initialised from random
  recent encoder vectors.

Nothing here communicates between processes: callers sum counts/sums over ranks before `EMACodebook.update_` and
make every rank restart the same codes with the same vectors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from trainlab.dtypes import at_least_float32
from trainlab.models.var.quantizer import MultiScaleQuantizer

# Shape legend: B batch, C code channels, h/w latent side, pn scale side, V vocab size, N tokens (B*pn*pn) of one
# scale, M tokens of all scales, S scales.


@dataclass
class CodeUsage:
    """Code-usage statistics of a set of per-scale codes: the one home of codebook usage (training metrics, held-out
    evaluation, tests). Tensors stay on the codes' device.

    Attributes:
        counts_SV: float32 hits per scale and code.
        counts_V: float32 hits per code, all scales pooled.
        used_frac: scalar: fraction of the V codes hit at least once (pooled).
        perplexity: scalar: exp(entropy of the pooled hit histogram); V for uniform use, 1 for one code.
        dead_codes: scalar: codes never hit (pooled).
        used_frac_S: per scale, the fraction of codes hit at least once.
    """

    counts_SV: torch.Tensor
    counts_V: torch.Tensor
    used_frac: torch.Tensor
    perplexity: torch.Tensor
    dead_codes: torch.Tensor
    used_frac_S: torch.Tensor


def code_counts(idx_list: Sequence[torch.Tensor], vocab_size: int) -> torch.Tensor:
    """Hits per scale and code (S, V) float32 of per-scale codes (each (B, pn*pn) int64); counts of several batches
    add up."""
    return torch.stack([torch.bincount(idx.flatten(), minlength=vocab_size).float() for idx in idx_list])


def code_usage(idx_list: Sequence[torch.Tensor], vocab_size: int) -> CodeUsage:
    """Statistics of per-scale codes (each (B, pn*pn) int64)."""
    return usage_from_counts(code_counts(idx_list, vocab_size))


def usage_from_counts(counts_SV: torch.Tensor) -> CodeUsage:
    """Statistics of per-scale hit counts (S, V), e.g. `code_counts` summed over a held-out set."""
    counts_SV = counts_SV.float()
    counts_V = counts_SV.sum(dim=0)
    p_V = counts_V / counts_V.sum().clamp_min(1.0)
    entropy = -(p_V * p_V.clamp_min(1e-30).log()).sum()
    used_V = counts_V > 0
    return CodeUsage(
        counts_SV=counts_SV,
        counts_V=counts_V,
        used_frac=used_V.float().mean(),
        perplexity=entropy.exp(),
        dead_codes=(~used_V).sum().float(),
        used_frac_S=(counts_SV > 0).float().mean(dim=1),
    )


@torch.no_grad()
def scale_residuals(quantizer: MultiScaleQuantizer, f_BChw: torch.Tensor) -> list[torch.Tensor]:
    """Per scale, the vectors the quantizer matched against codes: (B*pn*pn, C) float32, row-major tokens.

    Scale si matches area_pool(f - f_hat_{si-1}, pn) (f itself at scale 0; no pooling at the last scale), where
    f_hat_{si-1} is the running reconstruction after the previous scales.
    """
    f_BChw = at_least_float32(f_BChw.detach())
    C = f_BChw.shape[1]
    f_hats = quantizer.f_to_fhat_per_scale(f_BChw)
    z_list: list[torch.Tensor] = []
    for si, pn in enumerate(quantizer.patch_nums):
        rest_BChw = f_BChw if si == 0 else f_BChw - f_hats[si - 1]
        if si != quantizer.num_scales - 1:
            rest_BChw = F.interpolate(rest_BChw, size=(pn, pn), mode="area")
        z_list.append(rest_BChw.permute(0, 2, 3, 1).reshape(-1, C))
    return z_list


def assignment_sums(
    z_list: Sequence[torch.Tensor], idx_list: Sequence[torch.Tensor], vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Hits per code (V,) and the sum of the vectors assigned to each code (V, C), all scales pooled, float32."""
    z_MC = torch.cat([at_least_float32(z) for z in z_list])
    idx_M = torch.cat([idx.flatten() for idx in idx_list])
    counts_V = torch.bincount(idx_M, minlength=vocab_size).float()
    sums_VC = z_MC.new_zeros(vocab_size, z_MC.shape[1]).index_add_(0, idx_M, z_MC)
    return counts_V, sums_VC


@dataclass
class StepAssignments:
    """Code assignments of all micro-batches of one optimizer step, so that EMA updates and dead-code restarts act
    once per step on exactly what one large batch would give (counts and sums add; residuals keep batch order)."""

    z_per_scale: list[list[torch.Tensor]] = field(default_factory=list)
    counts_V: torch.Tensor | None = None
    sums_VC: torch.Tensor | None = None

    def add(
        self, z_list: Sequence[torch.Tensor], idx_list: Sequence[torch.Tensor], counts_V: torch.Tensor, with_sums: bool
    ) -> None:
        """One micro-batch: its per-scale residuals (`scale_residuals`), codes and hits per code."""
        if with_sums:
            counts_V, sums_VC = assignment_sums(z_list, idx_list, int(counts_V.shape[0]))
            self.sums_VC = sums_VC if self.sums_VC is None else self.sums_VC + sums_VC
        self.counts_V = counts_V.clone() if self.counts_V is None else self.counts_V + counts_V
        if not self.z_per_scale:
            self.z_per_scale = [[] for _ in z_list]
        for scale, z in enumerate(z_list):
            self.z_per_scale[scale].append(z)

    def candidates(self) -> torch.Tensor:
        """Every residual vector of the step (M, C), scale by scale, in batch order: restart candidates."""
        return torch.cat([torch.cat(zs) for zs in self.z_per_scale])


class EMACodebook:
    """Exponential-moving-average codebook state (float32, on the codebook's device).

    Args:
        weight_VC: the current codebook; the state starts at N = 1, m = weight (the codebook is unchanged until hits).
        decay: d, 0.99 in VQ-VAE-2.
        epsilon: Laplace smoothing constant.
    """

    def __init__(self, weight_VC: torch.Tensor, decay: float = 0.99, epsilon: float = 1e-5) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"EMA decay must be in [0, 1), got {decay}")
        self.decay = decay
        self.epsilon = epsilon
        self.embed_sum_VC = at_least_float32(weight_VC.detach()).clone()
        self.cluster_size_V = torch.ones(weight_VC.shape[0], dtype=self.embed_sum_VC.dtype, device=weight_VC.device)

    @torch.no_grad()
    def update_(self, weight_VC: torch.Tensor, counts_V: torch.Tensor, sums_VC: torch.Tensor) -> None:
        """One EMA step from this batch's hits and assigned-vector sums; writes the new codebook into `weight_VC`."""
        d = self.decay
        self.cluster_size_V.mul_(d).add_(counts_V.to(self.cluster_size_V.dtype), alpha=1.0 - d)
        self.embed_sum_VC.mul_(d).add_(sums_VC.to(self.embed_sum_VC.dtype), alpha=1.0 - d)
        weight_VC.copy_(self.embed_sum_VC / self.smoothed_sizes().unsqueeze(1))

    def smoothed_sizes(self) -> torch.Tensor:
        """Laplace-smoothed cluster sizes N~ (V,); they sum to sum(N) and are never zero."""
        n = self.cluster_size_V.sum()
        V = self.cluster_size_V.numel()
        return (self.cluster_size_V + self.epsilon) / (n + V * self.epsilon) * n

    @torch.no_grad()
    def reset_codes_(self, dead_V: torch.Tensor, weight_VC: torch.Tensor) -> None:
        """After a restart: the restarted codes start again as fresh clusters of size 1 at their new vectors."""
        self.cluster_size_V[dead_V] = 1.0
        self.embed_sum_VC[dead_V] = weight_VC[dead_V].to(self.embed_sum_VC.dtype)

    def state_dict(self) -> dict[str, Any]:
        return {"cluster_size_V": self.cluster_size_V.clone(), "embed_sum_VC": self.embed_sum_VC.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.cluster_size_V.copy_(state["cluster_size_V"])
        self.embed_sum_VC.copy_(state["embed_sum_VC"])


class DeadCodeTracker:
    """Remembers the optimizer step at which each code was last hit.

    Args:
        vocab_size: V.
        threshold_steps: a code is dead once it has gone unhit for this many optimizer steps (>= 1).
        device: where the state lives.
    """

    def __init__(self, vocab_size: int, threshold_steps: int, device: torch.device) -> None:
        if threshold_steps < 1:
            raise ValueError(f"threshold_steps must be >= 1, got {threshold_steps}")
        self.threshold_steps = threshold_steps
        self.last_hit_V = torch.zeros(vocab_size, dtype=torch.long, device=device)

    def observe(self, counts_V: torch.Tensor, step: int) -> None:
        """Mark the codes hit at optimizer step `step`."""
        self.last_hit_V[counts_V > 0] = step

    def dead(self, step: int) -> torch.Tensor:
        """Bool mask (V,) of codes not hit during the last `threshold_steps` optimizer steps."""
        return (step - self.last_hit_V) >= self.threshold_steps

    def revive(self, dead_V: torch.Tensor, step: int) -> None:
        """Restarted codes get a fresh grace period."""
        self.last_hit_V[dead_V] = step

    def state_dict(self) -> dict[str, Any]:
        return {"last_hit_V": self.last_hit_V.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_hit_V.copy_(state["last_hit_V"])


@torch.no_grad()
def restart_codes_(
    weight_VC: torch.Tensor, dead_V: torch.Tensor, candidates_MC: torch.Tensor, generator: torch.Generator
) -> torch.Tensor:
    """Overwrite dead codes with distinct vectors drawn uniformly (without replacement) from `candidates_MC`.

    Two codes restarted from the same vector would be identical: their distances to every input tie, one of them
    wins by rounding alone and the other is dead again. So at most M codes restart per call (the lowest-numbered dead
    ones); the others stay dead and restart at a later step.

    Args:
        weight_VC: the codebook, changed in place.
        dead_V: bool mask of codes to restart.
        candidates_MC: recent encoder vectors (e.g. this batch's `scale_residuals`, all scales).
        generator: a CPU generator, so the draw is reproducible and resumable.

    Returns:
        Bool mask (V,) of the codes restarted.
    """
    restarted_V = torch.zeros_like(dead_V)
    dead_idx = dead_V.nonzero().flatten()[: candidates_MC.shape[0]]
    if dead_idx.numel() == 0:
        return restarted_V
    pick = torch.randperm(candidates_MC.shape[0], generator=generator)[: dead_idx.numel()].to(candidates_MC.device)
    weight_VC[dead_idx] = candidates_MC[pick].to(weight_VC.dtype)
    restarted_V[dead_idx] = True
    return restarted_V
