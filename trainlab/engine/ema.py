"""Averaged weights: a copy of a trained model that follows it by an exponential moving average (EMA of weights).

A recipe declares one in `TrainParts.averaged` ({"var_ema": WeightAverage(follows="var", decay=0.9999)}); the engine
does the rest, so that no recipe can get it wrong:

- the copy is made from the trained model right after `recipe.build` (before the precision mode casts the trained
  weights: the copy keeps the dtype it was built in), moved to the device, in eval mode, without gradients, in no
  optimizer, never DDP-wrapped or compiled;
- it is updated once per optimizer step of every phase that trains the model it follows, after that phase's
  `after_optimizer_step` (an overflow-skipped step is no step):

      average <- decay x average + (1 - decay) x model     (floating parameters; buffers are copied)

- it is in every checkpoint (and restored on resume, bit for bit), checked for NaN / inf like the trained weights,
  compared by `--debug`'s resume check, and handed to `train_step`, `evaluate` and `on_fit_end` under its name.

A momentum encoder that the method itself trains against (MoCo) stays inside its model: it is part of the
computation, not an average kept for evaluation.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class WeightAverage:
    """An averaged copy of a trained model, declared in `TrainParts.averaged` under the copy's name.

    Attributes:
        follows: the trained model it averages (a key of `TrainParts.models`, trained by at least one phase).
        decay: weight of the old average per optimizer step, in [0, 1) (e.g. 0.9999; 0 copies the model).
    """

    follows: str
    decay: float


def averaged_copy(model: nn.Module) -> nn.Module:
    """A copy of `model` to average into: the same weights, eval mode, no gradients.

    The module structure is deep-copied; its tensors (parameters, buffers, tensor attributes) are cloned first and
    handed to the copy, so that the copy works for any tensor subclass, fake tensors (the memory planner) included.
    """
    memo: dict[int, Any] = {}
    for module in model.modules():
        for value in [*module.parameters(recurse=False), *module.buffers(recurse=False), *vars(module).values()]:
            if isinstance(value, torch.Tensor) and id(value) not in memo:
                clone = value.detach().clone()
                memo[id(value)] = nn.Parameter(clone, requires_grad=False) if isinstance(value, nn.Parameter) else clone
    average = copy.deepcopy(model, memo)
    return average.eval().requires_grad_(False)


@torch.no_grad()
def update_average_(average: nn.Module, model: nn.Module, decay: float) -> None:
    """One EMA step: `average`'s floating parameters move (1 - decay) of the way to `model`'s (in `average`'s dtype);
    its buffers (BatchNorm statistics, counters) are copied."""
    averaged: list[torch.Tensor] = [p for p in average.parameters() if p.is_floating_point()]
    current: list[torch.Tensor] = [p for p in model.parameters() if p.is_floating_point()]
    if len(averaged) != len(current):
        raise ValueError(f"the averaged copy has {len(averaged)} floating parameters, its model {len(current)}")
    if averaged:
        if all(a.dtype == c.dtype and a.device == c.device for a, c in zip(averaged, current)):
            torch._foreach_lerp_(averaged, current, 1.0 - decay)
        else:  # e.g. fp32 average of pure fp16 weights
            for average_tensor, model_tensor in zip(averaged, current):
                average_tensor.lerp_(model_tensor.to(average_tensor.dtype), 1.0 - decay)
    for a, c in zip(average.buffers(), model.buffers()):
        a.copy_(c)
