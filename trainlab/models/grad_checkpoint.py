"""Activation checkpointing of one stage (a sub-module run as a unit) that keeps BatchNorm statistics exact.

`torch.utils.checkpoint` reruns the stage's forward in backward. A training-mode BatchNorm would then update its
running mean/var and `num_batches_tracked` a second time. `checkpoint_stage` recomputes with momentum 0.0 (running
statistics unchanged, the batch statistics used for normalisation are the same) and restores momentum and
`num_batches_tracked` afterwards, so the statistics are updated exactly once, as without checkpointing.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


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
