"""Optimizer settings, one spelling for every recipe: the nested `optim` group of a training config.

    --optim.name sgd|lars|adam|adamw
    --optim.learning-rate LR          the peak learning rate, or
    --optim.base-learning-rate LR     the rate per 256 images: peak = LR x batch_size / 256 (linear scaling)
    --optim.momentum M                SGD / LARS momentum
    --optim.betas B1 B2               Adam / AdamW betas
    --optim.weight-decay WD
    --optim.fused true|false          fused Adam / AdamW kernel (CUDA and CPU)

The former flat spellings (`--learning-rate`, `--base-learning-rate`, `--weight-decay`, `--betas`, `--optimizer`,
`--optimizer-momentum`, `--fused-optimizer`, and their YAML keys) are accepted with a warning until the next
release; a recipe with a former spelling of its own (CIFAR's `--momentum`) declares it on a subclass.

Each recipe sets its own defaults (`optim: OptimConfig = option(OptimConfig(name="sgd", learning_rate=0.1, ...))`)
and builds its optimizer with `config.optim.build(params, batch_size=..., device=...)`; the one linear-scaling rule
is `OptimConfig.peak_lr(batch_size)`. Exactly one of the two learning rates is set (the other is -1), so a rate is
never scaled, or not, behind the user's back.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from trainlab.config import option
from trainlab.errors import UsageError
from trainlab.optim.lars import LARS

OptimizerName = Literal["sgd", "lars", "adam", "adamw"]
BATCH_OF_BASE_RATE = 256
"""A base learning rate is per this many images (the linear-scaling convention of MoCo, MAE, VAR)."""


@dataclass(kw_only=True)
class OptimConfig:
    """Which optimizer and its settings."""

    name: OptimizerName = option("sgd", "sgd, lars (momentum), adam or adamw (betas)", deprecated=("--optimizer",))
    learning_rate: float = option(
        -1.0, "peak learning rate (-1: from --optim.base-learning-rate)", gt=0, sentinels=(-1,),
        deprecated=("--learning-rate",),
    )  # fmt: skip
    base_learning_rate: float = option(
        -1.0, "learning rate per 256 images: peak = this x batch_size / 256 (-1: --optim.learning-rate)", gt=0,
        sentinels=(-1,), deprecated=("--base-learning-rate",),
    )  # fmt: skip
    momentum: float = option(0.9, "momentum of sgd and lars", ge=0, lt=1, deprecated=("--optimizer-momentum",))
    betas: tuple[float, ...] = option(
        (0.9, 0.999), "beta1 beta2 of adam and adamw", ge=0, lt=1, deprecated=("--betas",)
    )
    weight_decay: float = option(0.0, "weight decay", ge=0, deprecated=("--weight-decay",))
    fused: bool = option(False, "fused adam / adamw kernel on CUDA and CPU", deprecated=("--fused-optimizer",))

    def validate(self) -> None:
        """Exactly one learning rate; two betas.

        Raises:
            UsageError: both or neither learning rate set, or not two betas.
        """
        given = [rate > 0 for rate in (self.learning_rate, self.base_learning_rate)]
        if all(given):
            raise UsageError(
                f"--optim.learning-rate {self.learning_rate:g} and --optim.base-learning-rate "
                f"{self.base_learning_rate:g} are both set; keep one (set the other to -1)"
            )
        if not any(given):
            raise UsageError("no learning rate: set --optim.learning-rate or --optim.base-learning-rate")
        if len(self.betas) != 2:
            raise UsageError(f"--optim.betas takes two values (beta1 beta2), got {len(self.betas)}: {list(self.betas)}")

    @property
    def scales_with_batch(self) -> bool:
        """Whether the peak learning rate is the base rate scaled by the batch size."""
        return self.learning_rate <= 0

    def peak_lr(self, batch_size: int) -> float:
        """The peak learning rate: `learning_rate`, or `base_learning_rate x batch_size / 256` (linear scaling;
        `batch_size` is the global batch of one optimizer step, accumulation included)."""
        if not self.scales_with_batch:
            return self.learning_rate
        return self.base_learning_rate * batch_size / BATCH_OF_BASE_RATE

    def describe_lr(self, batch_size: int) -> str:
        """The peak learning rate and where it comes from, for a log line."""
        if not self.scales_with_batch:
            return f"peak lr {self.learning_rate:.4g}"
        return (
            f"peak lr = base {self.base_learning_rate:.3g} x batch {batch_size} / {BATCH_OF_BASE_RATE} = "
            f"{self.peak_lr(batch_size):.4g}"
        )

    def build(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        *,
        batch_size: int,
        device: torch.device | None = None,
    ) -> torch.optim.Optimizer:
        """The optimizer over `params` (tensors, or param groups that may set their own `weight_decay` / `lr`) at
        the peak learning rate; the engine's schedule scales it per step.

        Args:
            params: the parameters to train, or param groups.
            batch_size: the global batch of one optimizer step (for a base learning rate).
            device: where the parameters live; `fused` applies on CUDA and CPU only.
        """
        lr = self.peak_lr(batch_size)
        if self.name == "sgd":
            return torch.optim.SGD(params, lr=lr, momentum=self.momentum, weight_decay=self.weight_decay)
        if self.name == "lars":
            return LARS(params, lr, weight_decay=self.weight_decay, momentum=self.momentum)
        betas = (self.betas[0], self.betas[1])
        fused = True if self.fused and device is not None and device.type in ("cuda", "cpu") else None
        if self.name == "adam":
            return torch.optim.Adam(params, lr=lr, betas=betas, weight_decay=self.weight_decay, fused=fused)
        return torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=self.weight_decay, fused=fused)
