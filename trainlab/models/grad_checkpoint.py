"""Activation checkpointing: the one switch every model offers, and a stage recompute that keeps BatchNorm exact.

A model that can recompute activations in backward has timm's method `set_grad_checkpointing(enabled)` (VAR, the
CIFAR ResNets / VGGs, the backbones, MoCo); the engine switches it through `set_grad_checkpointing(model, enabled)`
below, which says whether the model supports it. Recipes never toggle it themselves.

`torch.utils.checkpoint` reruns the stage's forward in backward. A training-mode BatchNorm would then update its
running mean/var and `num_batches_tracked` a second time. `checkpoint_stage` recomputes with momentum 0.0 (running
statistics unchanged, the batch statistics used for normalisation are the same) and restores momentum and
`num_batches_tracked` afterwards, so the statistics are updated exactly once, as without checkpointing.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


@runtime_checkable
class GradCheckpointing(Protocol):
    """A model that can recompute its activations in backward (timm's method)."""

    def set_grad_checkpointing(self, enabled: bool = True) -> None: ...


def supports_grad_checkpointing(model: nn.Module) -> bool:
    """Whether `model` has a `set_grad_checkpointing` method."""
    return isinstance(model, GradCheckpointing)


def set_grad_checkpointing(model: nn.Module, enabled: bool) -> bool:
    """Switch activation checkpointing of `model` on or off.

    Args:
        model: any module; one without `set_grad_checkpointing` is left as it is.
        enabled: recompute activations in backward (True) or keep them (False).

    Returns:
        Whether `model` supports it (and was switched).
    """
    if not isinstance(model, GradCheckpointing):
        return False
    model.set_grad_checkpointing(enabled)
    return True


@contextmanager
def frozen_batchnorm_statistics(stage: nn.Module) -> Iterator[None]:
    """Within the block, the stage's BatchNorm modules leave their running statistics and counters as they were."""
    norms = [m for m in stage.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    saved = [(m, m.momentum, None if m.num_batches_tracked is None else m.num_batches_tracked.clone()) for m in norms]
    for m in norms:
        m.momentum = 0.0
    try:
        yield
    finally:
        for m, momentum, count in saved:
            m.momentum = momentum
            if count is not None and m.num_batches_tracked is not None:
                m.num_batches_tracked.copy_(count)


def checkpoint_stage(stage: nn.Module, *inputs: Any) -> torch.Tensor:
    """`stage(*inputs)`, keeping only the inputs for backward, which reruns the stage (same RNG, same BN stats)."""

    def contexts() -> tuple[AbstractContextManager[None], AbstractContextManager[None]]:
        return nullcontext(), frozen_batchnorm_statistics(stage)

    out = checkpoint(stage, *inputs, use_reentrant=False, context_fn=contexts)
    assert isinstance(out, torch.Tensor)
    return out
