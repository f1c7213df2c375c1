"""The contract between the engine and a recipe.

A recipe is a typed config (a subclass of `TrainConfig`) plus an object with `build()` and `train_step()`. The
engine owns everything else: devices, precision, accumulation, DDP, clipping, schedules, checkpoints, logging.

Multi-optimizer recipes (a GAN's generator and discriminator) declare several `Phase`s. Each optimizer step runs
the phases in order over the same micro-batches; during a phase only that phase's parameters require gradients,
and only that phase's modules are DDP-wrapped in the mapping handed to `train_step`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.data import Dataset

from trainlab.config import option
from trainlab.engine.schedule import ScheduleConfig


@dataclass(kw_only=True)
class TrainConfig:
    """Engine settings shared by every recipe (recipes subclass this and add their own fields)."""

    run_dir: Path = option(Path("runs/default"), "output directory (config, metrics.jsonl, tb/, ckpt/, plots/)")
    seed: int = option(0, "one seed for init, data order and augmentation")
    device: str = option("auto", "cpu, cuda, cuda:N, or auto (cuda when available, else cpu; logged)")
    precision: str = option("fp32", "fp32, fp16, fp16-scale, bf16, fp16-amp, fp16-amp-scale, bf16-amp, bf16-amp-scale")
    keep_batchnorm_fp32: bool = option(True, "in pure fp16/bf16 modes keep BatchNorm weights and statistics in fp32")
    static_loss_scale: float = option(1024.0, "loss scale of the static policy (fp16-scale)")
    epochs: int = option(1, "number of epochs")
    max_steps: int = option(-1, "stop after this many optimizer steps (-1: run all epochs)")
    batch_size: int = option(128, "global batch per optimizer step (all processes x accumulation steps)")
    grad_accumulation: int = option(1, "micro-steps per optimizer step (same gradients as the large batch)")
    clip_grad_norm: float = option(0.0, "clip the total gradient norm to this value after unscaling (0: no clip)")
    schedule: ScheduleConfig = option(ScheduleConfig(), "learning-rate schedule")
    num_workers: int = option(0, "DataLoader worker processes")
    log_every: int = option(10, "log training metrics every N optimizer steps")
    eval_every_epochs: int = option(1, "evaluate every N epochs (and always after the last)")
    checkpoint_every: int = option(0, "also save ckpt/last.pt every N optimizer steps (0: at epoch ends only)")
    resume: str = option("", "'' (fresh run), 'auto' (ckpt/last.pt of run_dir if present) or a checkpoint path")
    tensorboard: bool = option(True, "write TensorBoard scalars to run_dir/tb")
    wandb: Literal["off", "online", "offline"] = option("off", "Weights & Biases logging mode")
    progress: bool = option(True, "show progress bars (only on a TTY)")
    deterministic: bool = option(False, "deterministic cuDNN kernels (slower)")
    ddp_find_unused_parameters: bool = option(False, "DDP find_unused_parameters (only for models that need it)")
    memory_snapshot: str = option("", "write a CUDA memory snapshot (pytorch.org/memory_viz) of the first steps here")
    debug: bool = option(False, "tiny data, a few steps, save, reload, more steps; check resumed losses match")

    def validate(self) -> None:
        from trainlab.errors import UsageError

        if self.batch_size <= 0:
            raise UsageError(f"--batch-size must be positive, got {self.batch_size}")
        if self.grad_accumulation <= 0:
            raise UsageError(f"--grad-accumulation must be >= 1, got {self.grad_accumulation}")
        if self.epochs <= 0:
            raise UsageError(f"--epochs must be positive, got {self.epochs}")
        if self.log_every <= 0:
            raise UsageError(f"--log-every must be positive, got {self.log_every}")


@dataclass
class Phase:
    """One optimizer and the modules it trains. Most recipes have exactly one phase, named 'main'."""

    name: str
    optimizer: torch.optim.Optimizer
    modules: list[str]
    clip_grad_norm: float | None = None  # None: use TrainConfig.clip_grad_norm


@dataclass
class TrainParts:
    """What `Recipe.build` returns."""

    models: dict[str, nn.Module]
    phases: list[Phase]
    train_dataset: Dataset[Any]
    collate_fn: Callable[[list[Any]], Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class Recipe(ABC):
    """Base class: subclasses set `config_class`, `name`, and implement `build` and `train_step`."""

    name: str = ""
    config_class: type[TrainConfig] = TrainConfig
    best_metric: str = ""  # key returned by evaluate(); '' disables best.pt
    best_mode: Literal["max", "min"] = "max"
    resume_must_match: tuple[str, ...] = ()  # config fields (besides the engine's) that a resume must keep

    def __init__(self, config: TrainConfig) -> None:
        self.config = config

    @abstractmethod
    def build(self, device: torch.device) -> TrainParts:
        """Create models (on `device`, fp32), optimizers and the training dataset."""

    @abstractmethod
    def train_step(self, models: Mapping[str, nn.Module], batch: Any, phase: str, step: int) -> dict[str, Any]:
        """Forward and loss of one micro-batch. Must return {'loss': scalar tensor, **metrics}."""

    def phase_active(self, phase: str, step: int) -> bool:
        """Whether `phase` trains at optimizer step `step` (e.g. a discriminator that starts late)."""
        return True

    def evaluate(self, models: Mapping[str, nn.Module], device: torch.device, epoch: int) -> dict[str, float]:
        """Metrics on held-out data after an epoch (rank 0 only). Default: none."""
        return {}

    @abstractmethod
    def debug_config(self) -> TrainConfig:
        """A tiny variant of `self.config` that trains in seconds on a CPU (used by --debug and tests)."""

    def state_dict(self) -> dict[str, Any]:
        """Recipe state beyond models/optimizers that must survive a resume (e.g. counters)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:  # noqa: B027 - optional hook, default: nothing to load
        """Restore what `state_dict` returned."""
