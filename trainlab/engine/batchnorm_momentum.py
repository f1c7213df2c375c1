"""BatchNorm's running statistics under gradient accumulation: the large batch's decay per optimizer step.

A BatchNorm layer in training updates its running statistics at every forward: r <- (1 - m) r + m x (the batch's
statistic x). One optimizer step over a large batch updates them once; the same step as k accumulated micro-batches
updates them k times, so the old statistics decay by (1 - m)^k per optimizer step instead of (1 - m). With

    m_micro = 1 - (1 - m)^(1 / k)

at every micro-batch they decay by exactly (1 - m) per optimizer step, as the large batch's do: k micro-batches with
identical statistics x leave r = (1 - m) r + m x, the large batch's update. What stays different is x itself: each
micro-batch's statistics (the large batch's, under the official SyncBatchNorm) and the forward's normalisation by them.
Layers with momentum None (a cumulative average) are left as they are.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm


def micro_step_momentum(momentum: float, num_micro_steps: int) -> float:
    """The per-micro-batch momentum whose k-fold decay is one update with `momentum`: 1 - (1 - m)^(1/k)."""
    return 1.0 - (1.0 - momentum) ** (1.0 / num_micro_steps)


def batchnorms(models: Iterable[nn.Module]) -> list[_BatchNorm]:
    """Every BatchNorm (1d/2d/3d, SyncBatchNorm) of `models`."""
    return [m for model in models for m in model.modules() if isinstance(m, _BatchNorm)]


def decay_per_optimizer_step_(models: Iterable[nn.Module], num_micro_steps: int) -> str:
    """Set every BatchNorm's momentum m to `micro_step_momentum(m, k)`, in place; returns what was set (a log line)."""
    layers = batchnorms(models)
    changed: dict[tuple[float, float], int] = {}
    cumulative = 0
    for layer in layers:
        if layer.momentum is None:
            cumulative += 1
            continue
        new = micro_step_momentum(layer.momentum, num_micro_steps)
        changed[(layer.momentum, new)] = changed.get((layer.momentum, new), 0) + 1
        layer.momentum = new
    parts = [f"{n} layer(s) momentum {old:g} -> {new:.6g}" for (old, new), n in sorted(changed.items())]
    if cumulative:
        parts.append(f"{cumulative} layer(s) with a cumulative average left as they are")
    return (
        f"BatchNorm under accumulation {num_micro_steps}: running statistics decay per optimizer step as the large "
        f"batch's ({'; '.join(parts) or 'no BatchNorm layers'})"
    )


def describe_per_micro_batch(models: Iterable[nn.Module], num_micro_steps: int) -> str | None:
    """The log line of the default under accumulation (each micro-batch applies the layer's own momentum), or None
    where there is no BatchNorm with a momentum."""
    momenta = sorted({m.momentum for m in batchnorms(models) if m.momentum is not None})
    if not momenta:
        return None
    decay = ", ".join(f"{(1 - m) ** num_micro_steps:.4g} (large batch {1 - m:.4g})" for m in momenta)
    return (
        f"BatchNorm under accumulation {num_micro_steps}: running statistics updated at each micro-batch, old "
        f"statistics kept per optimizer step: {decay}; --batchnorm-decay per-optimizer-step matches the large batch"
    )
