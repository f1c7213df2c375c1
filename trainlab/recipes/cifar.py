"""CIFAR-10 classification: VGG / ResNet with CIFAR stems under any precision mode (the precision lab's recipe).

Standard recipe (kuangliu/pytorch-cifar): random crop 4 + horizontal flip, SGD momentum 0.9, weight decay 5e-4,
cosine learning rate, 200 epochs, per-epoch test accuracy. The final-epoch accuracy is the result; the best epoch is
reported only as a labelled extra (choosing it uses the test set). Data: CIFAR-10 from --data.root, or --data.kind
fake: synthetic images written in CIFAR-10's file format (run_dir/fake-cifar10) and read by the same reader.
Shapes: B batch, K classes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from trainlab.config import option
from trainlab.data.cifar import CIFAR10_MEAN, CIFAR10_STD
from trainlab.data.cifar_config import CifarData, upgrade_fake_data
from trainlab.data.sources import open_split
from trainlab.data.transforms import Normalise, PadCropFlip
from trainlab.dtypes import at_least_float32
from trainlab.engine.metrics import progress
from trainlab.engine.recipe import Batch, Phase, Recipe, StepInfo, TrainConfig, TrainParts
from trainlab.engine.schedule import ScheduleConfig
from trainlab.models.cifar_resnet import CifarResNet
from trainlab.models.names import FORMER_CIFAR_NAMES, CifarModel
from trainlab.models.registry import create_model
from trainlab.optim.config import OptimConfig


@dataclasses.dataclass(kw_only=True)
class CifarOptimConfig(OptimConfig):
    """The optimizer group with CIFAR's former `--momentum` spelling (now `--optim.momentum`)."""

    momentum: float = option(0.9, "SGD momentum", ge=0, lt=1, deprecated=("--momentum", "--optimizer-momentum"))


@dataclasses.dataclass(kw_only=True)
class CifarConfig(TrainConfig):
    """Train a CIFAR-10 classifier (VGG-11/13/16/19, ResNet-18/34/50 with CIFAR stems, or their debug variants)."""

    run_dir: Path = option(
        Path("runs/cifar"), "the run's folder: config, metrics, checkpoints; launched again, it resumes", metavar="DIR"
    )
    model: CifarModel = option(
        "cifar_resnet18",
        "registry name: kuangliu's CIFAR ResNets / VGGs (3x3 stem, PyTorch's default init)",
        deprecated_values=FORMER_CIFAR_NAMES,
    )
    data: CifarData = option(CifarData(), "which images")
    epochs: int = option(200, "number of epochs", ge=1)
    batch_size: int = option(128, "global batch per optimizer step", gt=0)
    eval_batch_size: int = option(500, "batch size for the test-set evaluation", ge=1)
    optim: CifarOptimConfig = option(
        CifarOptimConfig(name="sgd", learning_rate=0.1, momentum=0.9, weight_decay=5e-4),
        "SGD, peak lr 0.1 at batch 128 (scale it with the batch size), momentum 0.9, weight decay 5e-4 on all "
        "parameters (the reference recipe)",
    )
    schedule: ScheduleConfig = option(ScheduleConfig(kind="cosine"), "learning-rate schedule (per optimizer step)")
    fake_data: int = option(
        0, "former spelling (until the next release): N > 0 is --data.kind fake --data.fake-size N", ge=0
    )

    def validate(self) -> None:
        super().validate()
        self.data, self.fake_data = upgrade_fake_data(self.data, self.fake_data), 0


class CifarRecipe(Recipe[CifarConfig]):
    name = "cifar"
    config_class = CifarConfig
    best_metric = "test_accuracy"
    best_mode = "max"
    resume_may_change = ("data.root", "data.download", "eval_batch_size")

    def __init__(self, config: CifarConfig) -> None:
        super().__init__(config)
        self._test_loader: DataLoader[Any] | None = None

    def build(self, device: torch.device) -> TrainParts:
        c = self.config
        model = create_model(c.model, num_classes=10).to(device)
        optimizer = c.optim.build(model.parameters(), batch_size=c.batch_size, device=device)
        units = model.shard_units() if isinstance(model, CifarResNet) else []  # VGG: one unit, the root
        return TrainParts(
            models={"model": model}, phases=[Phase("main", optimizer, ["model"])], shard_units={"model": units}
        )

    def build_data(self, parts: TrainParts, device: torch.device) -> Dataset[Batch]:
        c = self.config
        files = c.run_dir / "fake-cifar10"  # kind fake: written in CIFAR-10's format, read by the real reader
        train = open_split(c.data, "train", PadCropFlip(CIFAR10_MEAN, CIFAR10_STD), seed=c.seed, fake_files=files)
        test = open_split(c.data, "eval", Normalise(32, CIFAR10_MEAN, CIFAR10_STD), seed=c.seed, fake_files=files)
        assert train is not None and test is not None
        self._test_loader = DataLoader(test.images, batch_size=c.eval_batch_size, shuffle=False, num_workers=0)
        return train.images

    def example_batch(self, batch_size: int) -> Batch:
        return {"image": torch.zeros(batch_size, 3, 32, 32), "label": torch.zeros(batch_size, dtype=torch.long)}

    def train_step(self, models: Mapping[str, nn.Module], batch: Batch, phase: str, info: StepInfo) -> dict[str, Any]:
        img_B3HW, label_B = batch["image"], batch["label"]
        logits_BK = models["model"](img_B3HW)
        loss = F.cross_entropy(at_least_float32(logits_BK), label_B)
        return {"loss": loss, "accuracy": (logits_BK.argmax(-1) == label_B).float().mean()}

    def evaluate(self, models: Mapping[str, nn.Module], device: torch.device, epoch: int) -> dict[str, float]:
        assert self._test_loader is not None
        model = models["model"]
        dtype = next(model.parameters()).dtype
        correct, total, loss_sum = 0, 0, 0.0
        bar = progress(len(self._test_loader), f"eval epoch {epoch}", enabled=self.config.progress)
        for batch in self._test_loader:
            bar.update(1)
            img_B3HW, label_B = batch["image"], batch["label"]
            img_B3HW, label_B = img_B3HW.to(device, dtype=dtype), label_B.to(device)
            logits_BK = at_least_float32(model(img_B3HW))
            loss_sum += float(F.cross_entropy(logits_BK, label_B, reduction="sum"))
            correct += int((logits_BK.argmax(-1) == label_B).sum())
            total += len(label_B)
        bar.close()
        return {"test_accuracy": correct / total, "test_loss": loss_sum / total}

    def debug_config(self) -> CifarConfig:
        debug_model: CifarModel = (
            "cifar_vgg_debug" if self.config.model.startswith("cifar_vgg") else "cifar_resnet_debug"
        )
        return dataclasses.replace(
            self.config,
            model=debug_model,
            data=dataclasses.replace(self.config.data, kind="fake", fake_size=128, train_limit=0, eval_limit=0),
            batch_size=16,
            epochs=2,
            eval_batch_size=64,
        )
