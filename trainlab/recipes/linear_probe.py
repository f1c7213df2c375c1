"""Linear probe of a MoCo v3 backbone, the official protocol (facebookresearch/moco-v3 main_lincls.py).

The backbone (base encoder without its projector) is frozen in eval mode (its BatchNorm statistics never change: a
frozen model of the engine); a linear classifier, init N(0, 0.01) and bias 0, is trained with SGD (momentum 0.9,
weight decay 0), lr = base (ResNet 0.1, ViT 3) x batch / 256, cosine. After the first epoch (and every later one)
a check asserts that no backbone weight or BN statistic changed. The final-epoch accuracy is the result; the best
epoch only a labelled extra (choosing it uses the test set).

Data (`trainlab.data.probe_views`): `--data image_folder --data-root DIR` reads DIR/train/<class>/* and
DIR/val/<class>/* (any number of classes, ImageNet mean / std) with the official transforms at side S =
`--image-size`: train RandomResizedCrop(S, scale (0.08, 1)) + flip, drawn as a pure function of (seed, epoch, index);
eval Resize(round(S * 256 / 224)) + CenterCrop(S). CIFAR-10 trains with the same RandomResizedCrop(32) + flip (the
official transform at CIFAR size; the supervised RandomCrop(32, padding=4) is not used) and evaluates the 32 px test
images as they are. `--augment false` turns the train augmentation off (the bundled digits never have one: their
README numbers were measured without).
Shape legend: B batch, F feature width, K classes.
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
from trainlab.data.probe_views import ProbeFolder, ProbeTensorViews
from trainlab.data.ssl_views import IMAGENET_MEAN, IMAGENET_STD
from trainlab.data.tensors import NamedTensorDataset
from trainlab.engine.recipe import Batch, Phase, Recipe, StepInfo, TrainConfig, TrainParts
from trainlab.engine.schedule import ScheduleConfig
from trainlab.errors import UsageError
from trainlab.models.moco import MoCo, MocoArch, infer_arch, read_moco_state
from trainlab.recipes.moco import EvalImages, SslData, load_eval_images, load_train_images, normalisation


class Backbone(nn.Module):
    """The base encoder of a MoCo model as a feature extractor (its projector is not used)."""

    def __init__(self, moco: MoCo) -> None:
        super().__init__()
        self.encoder = moco.base_encoder
        self._moco_features = moco.features

    def forward(self, x_BCHW: torch.Tensor) -> torch.Tensor:
        return self._moco_features(x_BCHW)


def load_backbone(checkpoint: str, arch: MocoArch, image_size: int) -> tuple[MoCo, str]:
    """The MoCo model of `checkpoint` (official or trainlab), or a random-init `arch` when `checkpoint` is ''."""
    if not checkpoint:
        return MoCo(arch, dim=256, mlp_dim=512, image_size=image_size), f"random-init {arch}"
    state, _ = read_moco_state(checkpoint)
    kwargs = infer_arch(state, where=checkpoint)
    model = MoCo(**kwargs)
    model.load_state_dict(state)
    return model, f"{kwargs['arch']} from {checkpoint}"


@dataclasses.dataclass(kw_only=True)
class LinearProbeConfig(TrainConfig):
    """Linear classification on frozen MoCo v3 features (official main_lincls.py protocol)."""

    run_dir: Path = option(Path("runs/linear-probe"), "output directory")
    checkpoint: str = option("", "MoCo checkpoint (official main_moco.py or trainlab ckpt/last.pt); '': random init")
    arch: MocoArch = option("resnet_debug", "backbone when --checkpoint is '' (the random-init baseline)")
    data: SslData = option("digits", "digits, cifar10 or image-folder (data_root/train/<class>, data_root/val/<class>)")
    data_root: Path = option(Path("data/cifar10"), "cifar10: folder with cifar-10-batches-py/; image-folder: root")
    image_size: int = option(16, "input side (the pretraining size; digits 8-32; official 224)")
    augment: bool = option(True, "train RandomResizedCrop(S) + flip (cifar10, image-folder; digits never)")
    base_learning_rate: float = option(0.1, "lr per 256 images (official: ResNet 0.1, ViT 3)")
    batch_size: int = option(256, "global batch per optimizer step (official 1024)")
    epochs: int = option(90, "number of epochs (official 90)")
    schedule: ScheduleConfig = option(ScheduleConfig(kind="cosine"), "cosine decay, no warm-up (official)")
    eval_subset: int = option(0, "N > 0: use the first N images of each split (debug)")

    def validate(self) -> None:
        super().validate()
        if self.data == "digits" and not 8 <= self.image_size <= 32:
            raise UsageError(f"digits are 8 to 32 px; got --image-size {self.image_size}")
        if self.image_size < 1:
            raise UsageError(f"--image-size must be positive, got {self.image_size}")


class LinearProbeRecipe(Recipe[LinearProbeConfig]):
    name = "linear-probe"
    config_class = LinearProbeConfig
    resume_must_match = ("checkpoint", "data", "image_size", "augment")
    resume_may_change = ("data_root",)  # a moved dataset (another size is refused)

    def __init__(self, config: LinearProbeConfig) -> None:
        super().__init__(config)
        self._images: EvalImages | None = None
        self._folders: tuple[ProbeFolder, ProbeFolder] | None = None
        self._initial: dict[str, torch.Tensor] = {}
        self.source = ""

    def _data(self) -> EvalImages:
        """Digits / CIFAR-10 in memory, normalised, no augmentation (the train split for un-augmented training)."""
        if self._images is None:
            c = self.config
            self._images = load_eval_images(c.data, c.data_root, c.image_size, c.seed, c.eval_subset)
        return self._images

    def _folder_splits(self) -> tuple[ProbeFolder, ProbeFolder]:
        """data_root/train (train transform) and data_root/val (eval transform); the class folders must match."""
        if self._folders is None:
            c = self.config
            common = {"image_size": c.image_size, "seed": c.seed, "mean": IMAGENET_MEAN, "std": IMAGENET_STD}
            train = ProbeFolder(c.data_root / "train", train=c.augment, subset=c.eval_subset, **common)  # type: ignore[arg-type]
            val = ProbeFolder(c.data_root / "val", train=False, subset=c.eval_subset, **common)  # type: ignore[arg-type]
            if train.classes != val.classes:
                raise UsageError(
                    f"{c.data_root}: train/ has {len(train.classes)} class folders and val/ {len(val.classes)}, "
                    "not the same names; the linear probe needs one class list"
                )
            self._folders = (train, val)
        return self._folders

    def num_classes(self) -> int:
        """K: the class folders of an image folder, 10 for digits and CIFAR-10."""
        return self._folder_splits()[0].num_classes if self.config.data == "image-folder" else 10

    def build(self, device: torch.device) -> TrainParts:
        c = self.config
        moco, self.source = load_backbone(c.checkpoint, c.arch, c.image_size)
        backbone = Backbone(moco).to(device).eval()  # eval before any forward: train mode would move BN statistics
        self._initial = {k: v.detach().clone() for k, v in backbone.state_dict().items()}
        with torch.no_grad():
            width = backbone(torch.zeros(2, 3, c.image_size, c.image_size, device=device)).shape[1]
        classifier = nn.Linear(width, self.num_classes()).to(device)
        nn.init.normal_(classifier.weight, mean=0.0, std=0.01)
        nn.init.zeros_(classifier.bias)
        lr = c.base_learning_rate * c.batch_size / 256
        optimizer = torch.optim.SGD(classifier.parameters(), lr=lr, momentum=0.9, weight_decay=0.0)
        return TrainParts(
            models={"classifier": classifier},
            phases=[Phase("main", optimizer, ["classifier"])],
            frozen={"backbone": backbone},
        )

    def build_data(self, parts: TrainParts, device: torch.device) -> Dataset[Batch]:
        c = self.config
        if c.data == "image-folder":
            return self._folder_splits()[0]
        if c.data == "cifar10" and c.augment:
            images_N3HW, labels_N = load_train_images(c.data, c.data_root, c.image_size, c.seed)
            if c.eval_subset > 0:
                images_N3HW, labels_N = images_N3HW[: c.eval_subset], labels_N[: c.eval_subset]
            mean, std = normalisation(c.data)
            return ProbeTensorViews(images_N3HW, labels_N, image_size=c.image_size, seed=c.seed, mean=mean, std=std)
        images = self._data()
        return NamedTensorDataset(image=images.bank_N3HW, label=images.bank_labels_N)

    def example_batch(self, batch_size: int) -> Batch:
        s = self.config.image_size
        return {"image": torch.zeros(batch_size, 3, s, s), "label": torch.zeros(batch_size, dtype=torch.long)}

    def train_step(self, models: Mapping[str, nn.Module], batch: Batch, phase: str, info: StepInfo) -> dict[str, Any]:
        with torch.no_grad():
            feats_BF = models["backbone"](batch["image"].float())
        logits_BK = models["classifier"](feats_BF.to(batch["image"].dtype))
        loss = F.cross_entropy(logits_BK.float(), batch["label"])
        return {"loss": loss, "accuracy": (logits_BK.argmax(-1) == batch["label"]).float().mean()}

    def evaluate(self, models: Mapping[str, nn.Module], device: torch.device, epoch: int) -> dict[str, float]:
        backbone, classifier = models["backbone"], models["classifier"]
        # The official sanity check, after the first epoch (`epoch` counts completed epochs) and every later one: no
        # backbone weight or BatchNorm statistic changed.
        for key, value in backbone.state_dict().items():
            assert torch.equal(value, self._initial[key].to(value.device)), f"backbone {key} changed"
        batches: Any
        if self.config.data == "image-folder":
            val = self._folder_splits()[1]
            batches = DataLoader(val, batch_size=256, shuffle=False, num_workers=self.config.num_workers)
            total = len(val)
        else:
            images = self._data()
            batches = (
                {"image": images.query_N3HW[s : s + 512], "label": images.query_labels_N[s : s + 512]}
                for s in range(0, images.query_N3HW.shape[0], 512)
            )
            total = int(images.query_N3HW.shape[0])
        dtype = next(classifier.parameters()).dtype
        correct = 0
        with torch.no_grad():
            for batch in batches:
                logits = classifier(backbone(batch["image"].to(device)).to(dtype))
                correct += int((logits.argmax(-1).cpu() == batch["label"]).sum())
        return {"test_accuracy": correct / total}

    def debug_config(self) -> LinearProbeConfig:
        return dataclasses.replace(
            self.config,
            data="digits",
            image_size=16,
            eval_subset=256,
            batch_size=32,
            epochs=2,
            log_every=1,
            max_steps=-1,
            debug=False,
        )
