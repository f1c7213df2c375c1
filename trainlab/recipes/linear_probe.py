"""Linear probe of a MoCo v3 backbone, the official protocol (facebookresearch/moco-v3 main_lincls.py).

The backbone (base encoder without its projector) is frozen in eval mode (its BatchNorm statistics never change: a
frozen model of the engine); a linear classifier, init N(0, 0.01) and bias 0, is trained with SGD (momentum 0.9,
weight decay 0), lr = base (ResNet 0.1, ViT 3) x batch / 256, cosine. After the first epoch (and at every
evaluation) a check asserts that no backbone weight or BN statistic changed. The final-epoch accuracy is the result;
the best evaluated epoch only a labelled extra (choosing it uses the test set).

Data (`trainlab.data.probe_views`): `--data image-folder --data-root DIR` reads DIR/train/<class>/* and
DIR/val/<class>/* (any number of classes, ImageNet mean / std) with the official transforms at side S =
`--image-size`: train RandomResizedCrop(S, scale (0.08, 1)) + flip, drawn as a pure function of (seed, epoch, index);
eval Resize(round(S * 256 / 224)) + CenterCrop(S). CIFAR-10 trains with the same RandomResizedCrop(32) + flip (the
official transform at CIFAR size; the supervised RandomCrop(32, padding=4) is not used) and evaluates the 32 px test
images as they are. `--augment false` turns the train augmentation off (the bundled digits never have one: their
README numbers were measured without).

Data set and side default to the backbone's own: a trainlab MoCo checkpoint records the `data`, `image_size` and
`data_root` it was pretrained with, an official ViT checkpoint its side (the position table fixes it); a flag that
differs is used and said in a warning (evaluating a backbone on other data is a legitimate transfer test), except a
ViT side, which its position table does not allow. Without a checkpoint (or an official ResNet one): digits at 16 px.

Cadence: evaluation every 10 epochs (and after the last: the result is the final epoch's), training metrics every 50
steps, so a 90-epoch probe on the digits (1,350 steps, under a minute on a CPU) logs tens of lines, not hundreds.
Shape legend: B batch, F feature width, K classes.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, get_args

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from trainlab.config import option
from trainlab.data.probe_views import ProbeFolder, ProbeTensorViews
from trainlab.data.ssl_views import IMAGENET_MEAN, IMAGENET_STD
from trainlab.data.tensors import NamedTensorDataset
from trainlab.dtypes import at_least_float32
from trainlab.engine.checkpoint import is_trainlab_checkpoint, stored_config, weights_in_checkpoint
from trainlab.engine.recipe import Batch, Phase, Recipe, StepInfo, TrainConfig, TrainParts
from trainlab.engine.schedule import ScheduleConfig
from trainlab.errors import UsageError
from trainlab.models.moco import MoCo, MocoArch, build_moco, infer_arch, read_moco_state
from trainlab.recipes.moco import (
    EvalImages,
    MocoConfig,
    SslData,
    check_image_size,
    load_eval_images,
    load_train_images,
    normalisation,
)

log = logging.getLogger(__name__)

DEFAULT_DATA: SslData = "digits"  # without a checkpoint that says otherwise
DEFAULT_IMAGE_SIZE = 16
DEFAULT_DATA_ROOT = Path("data/cifar10")


class Backbone(nn.Module):
    """The base encoder of a MoCo model as a feature extractor (its projector is not used)."""

    def __init__(self, moco: MoCo) -> None:
        super().__init__()
        self.encoder = moco.base_encoder
        self._moco_features = moco.features

    def forward(self, x_BCHW: torch.Tensor) -> torch.Tensor:
        return self._moco_features(x_BCHW)


def load_backbone(checkpoint: str, arch: MocoArch, image_size: int) -> tuple[MoCo, str]:
    """The MoCo model of `checkpoint` (official or trainlab), or a random-init `arch` when `checkpoint` is ''.

    Raises:
        UsageError: an unreadable checkpoint or weights that do not fit its architecture (see `build_moco`).
    """
    if not checkpoint:
        return MoCo(arch, dim=256, mlp_dim=512, image_size=image_size), f"random-init {arch}"
    state, _ = _read_moco_checkpoint(checkpoint)
    model = build_moco(state, where=checkpoint)
    return model, f"{model.arch} from {checkpoint}"


@dataclasses.dataclass(frozen=True)
class EvalData:
    """The data an evaluation of a backbone reads: set, side in pixels, root folder."""

    data: SslData
    image_size: int
    data_root: Path


def _read_moco_checkpoint(checkpoint: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The MoCo weights of `checkpoint` (official, or a trainlab `moco` run's ckpt/last.pt) and the config a trainlab
    run recorded, under today's setting names ({} for official files)."""
    config: dict[str, Any] = {}
    moco_weights = weights_in_checkpoint("moco")  # the moco recipe's model

    def unwrap(obj: Any, path: Path) -> Any:
        if is_trainlab_checkpoint(obj):
            config.update(stored_config(obj, MocoConfig, where=f"checkpoint {path}") or {})
        return moco_weights(obj, path)

    state, _ = read_moco_state(checkpoint, unwrap=unwrap)
    return state, config


def _pretrained_on(checkpoint: str) -> tuple[dict[str, Any], str]:
    """What `checkpoint` says about its pretraining data ({"data", "image_size", "data_root"}, any of them absent),
    and the architecture: a trainlab run records its config; an official ViT's position table fixes its side."""
    if not checkpoint:
        return {}, ""
    state, config = _read_moco_checkpoint(checkpoint)
    arch = infer_arch(state, where=checkpoint)
    found: dict[str, Any] = {}
    if config.get("data") in get_args(SslData):
        found["data"] = config["data"]
    if isinstance(config.get("image_size"), int):
        found["image_size"] = config["image_size"]
    if isinstance(config.get("data_root"), (str, Path)) and str(config["data_root"]):
        found["data_root"] = Path(config["data_root"])
    if "image_size" in arch:  # a ViT: its position table is for this side only
        found["image_size"] = arch["image_size"]
    return found, str(arch["arch"])


def resolve_eval_data(
    checkpoint: str, data: SslData | None, image_size: int | None, data_root: Path | None
) -> EvalData:
    """The data to evaluate a backbone on: each setting given on the command line, else the checkpoint's, else the
    default (digits, 16 px, data/cifar10). The data root is taken from the checkpoint only for the data set it was
    pretrained on (and said only for data sets read from a root).

    A given value that differs from the checkpoint's is used and said in a warning (a transfer evaluation is
    legitimate), except another side for a ViT, whose position table cannot take it.

    Raises:
        UsageError: an unreadable checkpoint, or a ViT side other than its own.
    """
    found, arch = _pretrained_on(checkpoint)
    if image_size is not None and arch.startswith("vit") and image_size != found["image_size"]:
        raise UsageError(
            f"--image-size {image_size}: {checkpoint} is a {arch} whose position table is for {found['image_size']} "
            f"px inputs; leave --image-size out (or pass {found['image_size']})"
        )
    resolved_data: SslData = data or found.get("data") or DEFAULT_DATA
    if resolved_data != found.get("data"):  # another data set: the pretraining root does not apply
        found.pop("data_root", None)
    given: dict[str, Any] = {"data": data, "image_size": image_size, "data_root": data_root}
    defaults: dict[str, Any] = {"data": DEFAULT_DATA, "image_size": DEFAULT_IMAGE_SIZE, "data_root": DEFAULT_DATA_ROOT}
    values: dict[str, Any] = {}
    taken: list[str] = []
    for key, value in given.items():
        if value is not None:
            values[key] = value
            if key in found and value != found[key]:
                log.warning("%s was pretrained with %s %s; evaluating with --%s %s as asked", checkpoint, key,
                            found[key], key.replace("_", "-"), value)  # fmt: skip
        elif key in found:
            values[key] = found[key]
            if key != "data_root" or resolved_data != "digits":  # the bundled digits read no root
                taken.append(f"{key} {found[key]}")
        else:
            values[key] = defaults[key]
    if taken:
        log.info("%s from the checkpoint %s", ", ".join(taken), checkpoint)
    if values["data"] == "digits" and not 8 <= values["image_size"] <= 32:
        raise UsageError(f"digits are 8 to 32 px; got image size {values['image_size']}: pass --image-size")
    return EvalData(data=values["data"], image_size=values["image_size"], data_root=values["data_root"])


@dataclasses.dataclass(kw_only=True)
class LinearProbeConfig(TrainConfig):
    """Linear classification on frozen MoCo v3 features (official main_lincls.py protocol)."""

    run_dir: Path = option(Path("runs/linear-probe"), "output directory")
    checkpoint: str = option("", "MoCo checkpoint (official main_moco.py or trainlab ckpt/last.pt); '': random init")
    arch: MocoArch = option("resnet_debug", "backbone when --checkpoint is '' (the random-init baseline)")
    data: SslData | None = option(
        None,
        "digits, cifar10 or image-folder (data_root/train/<class>, data_root/val/<class>); "
        "default: the checkpoint's, else digits",
    )
    data_root: Path | None = option(
        None, "cifar10: folder with cifar-10-batches-py/; image-folder: root; default: the checkpoint's, else "
        "data/cifar10",
    )  # fmt: skip
    image_size: int | None = option(
        None, "input side (digits 8-32; official 224); default: the checkpoint's pretraining side, else 16", ge=1
    )
    augment: bool = option(True, "train RandomResizedCrop(S) + flip (cifar10, image-folder; digits never)")
    base_learning_rate: float = option(0.1, "lr per 256 images (official: ResNet 0.1, ViT 3)", gt=0)
    batch_size: int = option(256, "global batch per optimizer step (official 1024)", gt=0)
    epochs: int = option(90, "number of epochs (official 90)", ge=1)
    schedule: ScheduleConfig = option(ScheduleConfig(kind="cosine"), "cosine decay, no warm-up (official)")
    eval_subset: int = option(0, "N > 0: use the first N images of each split (debug; 0: all)", ge=0)
    log_every: int = option(50, "log training metrics every N optimizer steps", ge=1)
    eval_every_epochs: int = option(10, "evaluate every N epochs (and always after the last: the result)", ge=1)

    def validate(self) -> None:
        super().validate()
        # what is known before the checkpoint is read: the given values, or the defaults without a checkpoint
        data = self.data or (None if self.checkpoint else DEFAULT_DATA)
        size = self.image_size or (None if self.checkpoint else DEFAULT_IMAGE_SIZE)
        if data is not None and size is not None:
            check_image_size(data, size, None if self.checkpoint else self.arch)

    def eval_data(self) -> EvalData:
        """The data set, side and root the probe reads (see `resolve_eval_data`); all three set once resolved."""
        assert self.data is not None and self.image_size is not None and self.data_root is not None, "unresolved"
        return EvalData(self.data, self.image_size, self.data_root)


class LinearProbeRecipe(Recipe[LinearProbeConfig]):
    name = "linear-probe"
    config_class = LinearProbeConfig
    resume_may_change = ("data_root",)  # a moved dataset (another size is refused)

    def __init__(self, config: LinearProbeConfig) -> None:
        if config.data is None or config.image_size is None or config.data_root is None:  # from the checkpoint
            found = resolve_eval_data(config.checkpoint, config.data, config.image_size, config.data_root)
            config = dataclasses.replace(
                config, data=found.data, image_size=found.image_size, data_root=found.data_root
            )
            config.validate()
        super().__init__(config)
        self._images: EvalImages | None = None
        self._folders: tuple[ProbeFolder, ProbeFolder] | None = None
        self._initial: dict[str, torch.Tensor] = {}
        self.source = ""

    def _data(self) -> EvalImages:
        """Digits / CIFAR-10 in memory, normalised, no augmentation (the train split for un-augmented training)."""
        if self._images is None:
            c, d = self.config, self.config.eval_data()
            self._images = load_eval_images(d.data, d.data_root, d.image_size, c.seed, c.eval_subset)
        return self._images

    def _folder_splits(self) -> tuple[ProbeFolder, ProbeFolder]:
        """data_root/train (train transform) and data_root/val (eval transform); the class folders must match."""
        if self._folders is None:
            c, d = self.config, self.config.eval_data()
            common = {"image_size": d.image_size, "seed": c.seed, "mean": IMAGENET_MEAN, "std": IMAGENET_STD}
            train = ProbeFolder(d.data_root / "train", train=c.augment, subset=c.eval_subset, **common)  # type: ignore[arg-type]
            val = ProbeFolder(d.data_root / "val", train=False, subset=c.eval_subset, **common)  # type: ignore[arg-type]
            if train.classes != val.classes:
                raise UsageError(
                    f"{d.data_root}: train/ has {len(train.classes)} class folders and val/ {len(val.classes)}, "
                    "not the same names; the linear probe needs one class list"
                )
            self._folders = (train, val)
        return self._folders

    def num_classes(self) -> int:
        """K: the class folders of an image folder, 10 for digits and CIFAR-10."""
        return self._folder_splits()[0].num_classes if self.config.data == "image-folder" else 10

    def build(self, device: torch.device) -> TrainParts:
        c, side = self.config, self.config.eval_data().image_size
        moco, self.source = load_backbone(c.checkpoint, c.arch, side)
        backbone = Backbone(moco).to(device).eval()  # eval before any forward: train mode would move BN statistics
        self._initial = {k: v.detach().clone() for k, v in backbone.state_dict().items()}
        with torch.no_grad():
            width = backbone(torch.zeros(2, 3, side, side, device=device)).shape[1]
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
        c, d = self.config, self.config.eval_data()
        if d.data == "image-folder":
            return self._folder_splits()[0]
        if d.data == "cifar10" and c.augment:
            images_N3HW, labels_N = load_train_images(d.data, d.data_root, d.image_size, c.seed)
            if c.eval_subset > 0:
                images_N3HW, labels_N = images_N3HW[: c.eval_subset], labels_N[: c.eval_subset]
            mean, std = normalisation(d.data)
            return ProbeTensorViews(images_N3HW, labels_N, image_size=d.image_size, seed=c.seed, mean=mean, std=std)
        images = self._data()
        return NamedTensorDataset(image=images.bank_N3HW, label=images.bank_labels_N)

    def example_batch(self, batch_size: int) -> Batch:
        s = self.config.eval_data().image_size
        return {"image": torch.zeros(batch_size, 3, s, s), "label": torch.zeros(batch_size, dtype=torch.long)}

    def train_step(self, models: Mapping[str, nn.Module], batch: Batch, phase: str, info: StepInfo) -> dict[str, Any]:
        backbone = models["backbone"]
        with torch.no_grad():  # the frozen backbone keeps its own dtype (fp32; fp64 in an fp64 run)
            feats_BF = backbone(batch["image"].to(next(backbone.parameters()).dtype))
        logits_BK = models["classifier"](feats_BF.to(batch["image"].dtype))
        loss = F.cross_entropy(at_least_float32(logits_BK), batch["label"])
        return {"loss": loss, "accuracy": (logits_BK.argmax(-1) == batch["label"]).float().mean()}

    def after_optimizer_step(self, models: Mapping[str, nn.Module], phase: str, info: StepInfo) -> dict[str, float]:
        if info.step + 1 == info.steps_per_epoch:  # the official sanity check runs after the first epoch
            self._check_backbone(models["backbone"])
        return {}

    def _check_backbone(self, backbone: nn.Module) -> None:
        """The official sanity check: no backbone weight or BatchNorm statistic changed."""
        for key, value in backbone.state_dict().items():
            assert torch.equal(value, self._initial[key].to(value.device)), f"backbone {key} changed"

    def evaluate(self, models: Mapping[str, nn.Module], device: torch.device, epoch: int) -> dict[str, float]:
        backbone, classifier = models["backbone"], models["classifier"]
        self._check_backbone(backbone)  # after the first epoch (see after_optimizer_step) and at every evaluation
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
        )
