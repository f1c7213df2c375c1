"""CIFAR-10 classification: VGG / ResNet with CIFAR stems under any precision mode (the precision lab's recipe).

Standard recipe (kuangliu/pytorch-cifar): random crop 4 + horizontal flip, SGD momentum 0.9, weight decay 5e-4,
cosine learning rate, 200 epochs, per-epoch test accuracy. The final-epoch accuracy is the result; the best epoch is
reported only as a labelled extra (choosing it uses the test set). Shapes: B batch, K classes.
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
from trainlab.data.cifar import CifarAugmentDataset, load_cifar10
from trainlab.data.fake_cifar import write_fake_cifar10
from trainlab.dtypes import at_least_float32
from trainlab.engine.metrics import progress
from trainlab.engine.recipe import Batch, Phase, Recipe, StepInfo, TrainConfig, TrainParts
from trainlab.engine.schedule import ScheduleConfig
from trainlab.models.cifar_resnet import CifarResNet
from trainlab.models.cifar_vgg import CifarVGG
from trainlab.models.registry import create_model, list_models


@dataclasses.dataclass(kw_only=True)
class CifarConfig(TrainConfig):
    """Train a CIFAR-10 classifier (VGG-11/13/16/19, ResNet-18/34/50 with CIFAR stems, or their debug variants)."""

    run_dir: Path = option(Path("runs/cifar"), "output directory")
    model: str = option("resnet18", "vgg11, vgg13, vgg16, vgg19, resnet18, resnet34, resnet50, vgg_debug, resnet_debug")
    data_root: Path = option(Path("data/cifar10"), "folder holding cifar-10-batches-py/")
    download: bool = option(False, "download CIFAR-10 into data_root if it is missing (needs the network)")
    fake_data: int = option(
        0, "N > 0: write and use a synthetic CIFAR-format set of N train images (tests, debug)", ge=0
    )
    epochs: int = option(200, "number of epochs", ge=1)
    batch_size: int = option(128, "global batch per optimizer step", gt=0)
    eval_batch_size: int = option(500, "batch size for the test-set evaluation", ge=1)
    learning_rate: float = option(0.1, "peak learning rate (SGD); scale it with the batch size", gt=0)
    momentum: float = option(0.9, "SGD momentum", ge=0, lt=1)
    weight_decay: float = option(5e-4, "weight decay (all parameters, as in the reference recipe)", ge=0)
    schedule: ScheduleConfig = option(ScheduleConfig(kind="cosine"), "learning-rate schedule (per optimizer step)")

    def validate(self) -> None:
        super().validate()
        from trainlab.errors import UsageError

        if self.model not in list_models():
            raise UsageError(f"unknown model {self.model!r}; choose one of: {', '.join(list_models())}")


class CifarRecipe(Recipe[CifarConfig]):
    name = "cifar"
    config_class = CifarConfig
    best_metric = "test_accuracy"
    best_mode = "max"
    resume_may_change = ("data_root", "download", "eval_batch_size")
    supports_activation_checkpointing = True  # per ResNet stage / per VGG block between max-pools

    def __init__(self, config: CifarConfig) -> None:
        super().__init__(config)
        self._test_loader: DataLoader[Any] | None = None

    def _root(self) -> Path:
        c = self.config
        if c.fake_data > 0:
            root = c.run_dir / "fake-cifar10"
            if not (root / "cifar-10-batches-py").is_dir():
                write_fake_cifar10(root, num_train=c.fake_data, num_test=max(c.fake_data // 4, 16), seed=c.seed)
            return root
        return c.data_root

    def build(self, device: torch.device) -> TrainParts:
        c = self.config
        model = create_model(c.model, num_classes=10).to(device)
        assert isinstance(model, CifarResNet | CifarVGG), type(model)
        model.activation_checkpointing = c.activation_checkpointing
        optimizer = torch.optim.SGD(
            model.parameters(), lr=c.learning_rate, momentum=c.momentum, weight_decay=c.weight_decay
        )
        return TrainParts(models={"model": model}, phases=[Phase("main", optimizer, ["model"])])

    def build_data(self, parts: TrainParts, device: torch.device) -> Dataset[Batch]:
        c = self.config
        root = self._root()
        train_raw = load_cifar10(root, train=True, download=c.download)
        test_raw = load_cifar10(root, train=False, download=False)
        test_set = CifarAugmentDataset.from_cifar10(test_raw, augment=False)
        self._test_loader = DataLoader(test_set, batch_size=c.eval_batch_size, shuffle=False, num_workers=0)
        return CifarAugmentDataset.from_cifar10(train_raw, augment=True, seed=c.seed)

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
        debug_model = "vgg_debug" if self.config.model.startswith("vgg") else "resnet_debug"
        return dataclasses.replace(
            self.config,
            model=debug_model,
            fake_data=128,
            batch_size=16,
            epochs=2,
            eval_batch_size=64,
        )
