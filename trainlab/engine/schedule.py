"""Learning-rate and weight-decay schedules as pure functions of the optimizer step.

The engine calls `Scheduler.apply(step)` once per optimizer step (never per micro-step, never per process), so
the learning rate is a function of the step count alone and resumes exactly from a checkpoint's step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch

from trainlab.config import option

ScheduleKind = Literal["constant", "cosine", "linear", "var-lin0"]


@dataclass(kw_only=True)
class ScheduleConfig:
    """Learning-rate schedule: linear warm-up, then the chosen decay; optional weight-decay ramp."""

    kind: ScheduleKind = option("cosine", "decay after warm-up: constant, cosine, linear, var-lin0 (VAR's official)")
    warmup_fraction: float = option(0.0, "fraction of total optimizer steps spent warming up linearly", ge=0, lt=1)
    warmup_start_ratio: float = option(0.0, "learning rate at step 0 as a fraction of the peak (VAR: 0.005)", ge=0)
    final_ratio: float = option(0.0, "learning rate at the last step as a fraction of the peak (VAR: wpe)", ge=0)
    weight_decay_end: float = option(
        -1.0, "weight decay at the end, cosine from the start value; -1: constant", ge=0, sentinels=(-1,)
    )


def lr_factor(config: ScheduleConfig, step: int, total_steps: int) -> float:
    """Multiplier of the peak learning rate at optimizer step `step` (0-based) of `total_steps`."""
    total = max(total_steps, 1)
    warmup = round(config.warmup_fraction * total)
    if step < warmup:
        return config.warmup_start_ratio + (1 - config.warmup_start_ratio) * step / warmup
    if config.kind == "constant":
        return 1.0
    progress = min((step - warmup) / max(total - 1 - warmup, 1), 1.0)
    final = config.final_ratio
    if config.kind == "cosine":
        return final + (1 - final) * 0.5 * (1 + math.cos(math.pi * progress))
    if config.kind == "linear":
        return 1.0 + (final - 1.0) * progress
    # var-lin0: flat for the first 5 % of the post-warm-up span, then linear to `final` (VAR's `lin0`).
    flat = 0.05
    if progress < flat:
        return 1.0
    return 1.0 + (final - 1.0) * (progress - flat) / (1 - flat)


class Scheduler:
    """Sets every param group's lr (peak x factor) and, optionally, its weight decay, from the step count.

    Param groups keep their own peak in `group["peak_lr"]` (set at construction) so per-group ratios survive.
    Groups created with weight_decay == 0 stay at 0.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, config: ScheduleConfig, total_steps: int) -> None:
        self.optimizer = optimizer
        self.config = config
        self.total_steps = total_steps
        self.last_step = -1
        for group in optimizer.param_groups:
            group.setdefault("peak_lr", group["lr"])
            group.setdefault("start_weight_decay", group.get("weight_decay", 0.0))

    def apply(self, step: int) -> float:
        """Set lr / wd for optimizer step `step`; returns the first group's lr (for logging)."""
        factor = lr_factor(self.config, step, self.total_steps)
        progress = min(step / max(self.total_steps - 1, 1), 1.0)
        for group in self.optimizer.param_groups:
            group["lr"] = group["peak_lr"] * factor
            start_wd = group["start_weight_decay"]
            if self.config.weight_decay_end >= 0 and start_wd > 0:
                end_wd = self.config.weight_decay_end
                group["weight_decay"] = end_wd + (start_wd - end_wd) * 0.5 * (1 + math.cos(math.pi * progress))
        self.last_step = step
        return float(self.optimizer.param_groups[0]["lr"])

    def state_dict(self) -> dict[str, Any]:
        return {"last_step": self.last_step, "total_steps": self.total_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_step = int(state["last_step"])
        if self.last_step >= 0:
            self.apply(self.last_step)
