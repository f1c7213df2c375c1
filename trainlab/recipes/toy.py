"""A synthetic classification recipe: a small MLP on Gaussian clusters. Exercises the engine in seconds.

It has no BatchNorm, so data-parallel and accumulation runs are mathematically the same computation as one large
batch (the engine's equivalence tests rely on that). Shapes: B batch, D input features, K classes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from trainlab.config import option
from trainlab.data.tensors import NamedTensorDataset
from trainlab.dtypes import at_least_float32
from trainlab.engine.recipe import Batch, Phase, Recipe, StepInfo, TrainConfig, TrainParts
from trainlab.optim.config import OptimConfig


@dataclass(kw_only=True)
class ToyConfig(TrainConfig):
    """Synthetic Gaussian-cluster classification with a small MLP (engine smoke tests and demos)."""

    run_dir: Path = option(
        Path("runs/toy"), "the run's folder: config, metrics, checkpoints; launched again, it resumes", metavar="DIR"
    )
    num_samples: int = option(512, "training samples", ge=1)
    num_features: int = option(16, "input features", ge=1)
    num_classes: int = option(4, "classes", ge=1)
    hidden: int = option(32, "hidden width of the MLP", ge=1)
    dropout: float = option(0.0, "dropout probability (exercises the RNG state on resume)", ge=0, lt=1)
    optim: OptimConfig = option(
        OptimConfig(name="sgd", learning_rate=0.1, momentum=0.9, weight_decay=0.0), "optimizer (SGD, momentum 0.9)"
    )
    batch_size: int = option(32, "global batch per optimizer step", gt=0)
    step_sleep_seconds: float = option(0.0, "sleep in every step (lets tests interrupt a running job)", ge=0, le=3600)


def make_clusters(num_samples: int, num_features: int, num_classes: int, seed: int) -> NamedTensorDataset:
    """Samples {"input": (D,), "label": ()} around fixed class centres (the centres do not depend on `seed`)."""
    centers_KD = torch.randn(num_classes, num_features, generator=torch.Generator().manual_seed(12345)) * 2
    g = torch.Generator().manual_seed(seed + 1)
    labels_B = torch.randint(num_classes, (num_samples,), generator=g)
    x_BD = centers_KD[labels_B] + torch.randn(num_samples, num_features, generator=g)
    return NamedTensorDataset(input=x_BD, label=labels_B)


class ToyRecipe(Recipe[ToyConfig]):
    name = "toy"
    config_class = ToyConfig
    best_metric = "accuracy"
    resume_may_change = ("step_sleep_seconds",)

    def __init__(self, config: ToyConfig) -> None:
        super().__init__(config)
        self.eval_data = make_clusters(256, config.num_features, config.num_classes, seed=config.seed + 10_000)

    def build(self, device: torch.device) -> TrainParts:
        c = self.config
        model = nn.Sequential(
            nn.Linear(c.num_features, c.hidden),
            nn.GELU(),
            nn.Dropout(c.dropout),
            nn.Linear(c.hidden, c.num_classes),
        ).to(device)
        optimizer = c.optim.build(model.parameters(), batch_size=c.batch_size, device=device)
        return TrainParts(models={"model": model}, phases=[Phase("main", optimizer, ["model"])])

    def build_data(self, parts: TrainParts, device: torch.device) -> Dataset[Batch]:
        c = self.config
        return make_clusters(c.num_samples, c.num_features, c.num_classes, seed=c.seed)

    def example_batch(self, batch_size: int) -> Batch:
        return {
            "input": torch.zeros(batch_size, self.config.num_features),
            "label": torch.zeros(batch_size, dtype=torch.long),
        }

    def train_step(self, models: Mapping[str, nn.Module], batch: Batch, phase: str, info: StepInfo) -> dict[str, Any]:
        x_BD, y_B = batch["input"], batch["label"]
        if self.config.step_sleep_seconds:
            import time

            time.sleep(self.config.step_sleep_seconds)
        logits_BK = models["model"](x_BD)
        loss = F.cross_entropy(at_least_float32(logits_BK), y_B)
        return {"loss": loss, "accuracy": (logits_BK.argmax(-1) == y_B).float().mean()}

    def evaluate(self, models: Mapping[str, nn.Module], device: torch.device, epoch: int) -> dict[str, float]:
        x_BD, y_B = (self.eval_data.tensors[k].to(device) for k in ("input", "label"))
        dtype = next(models["model"].parameters()).dtype
        logits_BK = models["model"](x_BD.to(dtype))
        return {"accuracy": float((logits_BK.argmax(-1) == y_B).float().mean())}

    def debug_config(self) -> ToyConfig:
        return replace(self.config, num_samples=128, batch_size=16, epochs=2, log_every=1, debug=False)
