"""Linear probe of a MoCo v3 backbone, the official protocol (facebookresearch/moco-v3 main_lincls.py).

The backbone (base encoder without its projector) is frozen in eval mode (its BatchNorm statistics never change: a
frozen model of the engine); a linear classifier, init N(0, 0.01) and bias 0, is trained with SGD (momentum 0.9,
weight decay 0), lr = base (ResNet 0.1, ViT 3) x batch / 256 (`--optim.base-learning-rate`), cosine. After the first
epoch (and at every evaluation) a check asserts that no backbone weight or BN statistic changed. The final-epoch
accuracy is the result; the best evaluated epoch only a labelled extra (choosing it uses the test set).

Data (`trainlab.data.sources.open_split`): `--data.kind image-folder --data.root DIR` reads DIR/train/<class>/* and
DIR/val/<class>/* (any number of classes, ImageNet mean / std) with the official transforms at side S =
`--image-size`: train `random_resized_crop_flip` (RandomResizedCrop(S, scale (0.08, 1)) + flip, drawn as a pure
function of (seed, epoch, index)); eval `resize_center_crop` (Resize(round(S * 256 / 224)) + CenterCrop(S)). CIFAR-10
trains with the same RandomResizedCrop(32) + flip (the official transform at CIFAR size; the supervised
RandomCrop(32, padding=4) is not used) and evaluates the 32 px test images as they are. `--augment false` turns the
train augmentation off (the bundled digits and fake images never have one: the digits' README numbers were measured
without). `--data.train-limit` / `--data.eval-limit` cap the training / test images.

Data set, root and side default to the backbone's own: a trainlab MoCo checkpoint records the `data.kind`, `data.root`
and `image_size` it was pretrained with, an official ViT checkpoint its side (the position table fixes it); a flag
that differs is used and said in a warning (evaluating a backbone on other data is a legitimate transfer test),
except a ViT side, which its position table does not allow. Without a checkpoint (or an official ResNet one): digits
at 16 px.

Cadence: evaluation every 10 epochs (and after the last: the result is the final epoch's), training metrics every 50
steps, so a 90-epoch probe on the digits (1,350 steps, under a minute on a CPU) logs tens of lines, not hundreds.
Shape legend: B batch, F feature width, K classes.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from trainlab.config import option
from trainlab.data.config import (
    DATA_KINDS,
    DataConfig,
    DataKind,
    check_download,
    check_image_size,
    download_option,
    eval_limit_option,
    fake_size_option,
    kind_option,
    root_option,
    train_limit_option,
)
from trainlab.data.loader_workers import ignore_stop_signals
from trainlab.data.sources import ImageSplit, normalisation, num_classes, open_split
from trainlab.data.transforms import RandomResizedCropFlip, ResizeCenterCrop
from trainlab.dtypes import at_least_float32
from trainlab.engine.checkpoint import is_trainlab_checkpoint, stored_config, weights_in_checkpoint
from trainlab.engine.recipe import Batch, Phase, Recipe, StepInfo, TrainConfig, TrainParts
from trainlab.engine.schedule import ScheduleConfig
from trainlab.errors import UsageError
from trainlab.models.backbones.vit import check_vit_image_size
from trainlab.models.moco import MoCo, build_moco, infer_arch, read_moco_state
from trainlab.models.names import FORMER_MOCO_BACKBONES, MOCO_BACKBONE_FAMILY, MocoBackbone, ModelFamily
from trainlab.optim.config import OptimConfig

log = logging.getLogger(__name__)

DEFAULT_KIND: DataKind = "digits"  # without a checkpoint that says otherwise
DEFAULT_IMAGE_SIZE = 16
DEFAULT_ROOT = Path("data/cifar10")


class Backbone(nn.Module):
    """The base encoder of a MoCo model as a feature extractor (its projector is not used)."""

    def __init__(self, moco: MoCo) -> None:
        super().__init__()
        self.encoder = moco.base_encoder
        self._moco_features = moco.features

    def forward(self, x_BCHW: torch.Tensor) -> torch.Tensor:
        return self._moco_features(x_BCHW)


def load_backbone(checkpoint: str, model: MocoBackbone, image_size: int) -> tuple[MoCo, str]:
    """The MoCo model of `checkpoint` (official or trainlab), or a random-init `model` backbone when `checkpoint` is
    ''.

    Raises:
        UsageError: an unreadable checkpoint or weights that do not fit its architecture (see `build_moco`).
    """
    if not checkpoint:
        return MoCo(model, dim=256, mlp_dim=512, image_size=image_size), f"random-init {model}"
    state, _ = _read_moco_checkpoint(checkpoint)
    moco = build_moco(state, where=checkpoint)
    return moco, f"{moco.backbone} from {checkpoint}"


@dataclasses.dataclass(kw_only=True)
class ProbeData:
    """The images a backbone is evaluated on: `DataConfig`'s fields, where kind and root left unset are the
    checkpoint's pretraining data (`resolve_eval_data`)."""

    kind: DataKind | None = kind_option(
        None, DataKind, "default: the checkpoint's, else digits", deprecated=("--data",)
    )
    root: Path | None = root_option(
        None, DataKind, "default: the checkpoint's, else data/cifar10", deprecated=("--data-root",)
    )
    train_limit: int = train_limit_option()
    eval_limit: int = eval_limit_option(0, "test images", deprecated=("--eval-subset",))
    fake_size: int = fake_size_option()
    download: bool = download_option()

    def validate(self) -> None:
        check_download(self.kind, self.download)

    def resolved(self) -> DataConfig:
        """The data config to read, once kind and root are known (`resolve_eval_data`)."""
        assert self.kind is not None and self.root is not None, "unresolved: see resolve_eval_data"
        return DataConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)})


def _read_moco_checkpoint(checkpoint: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The MoCo weights of `checkpoint` (official, or a trainlab `moco` run's ckpt/last.pt) and the config a trainlab
    run recorded, under today's setting names ({} for official files)."""
    config: dict[str, Any] = {}
    moco_weights = weights_in_checkpoint("moco")  # the moco recipe's model

    def unwrap(obj: Any, path: Path) -> Any:
        if is_trainlab_checkpoint(obj):
            # under today's names of what the probe reads (the data group, the side): its own fields declare the
            # same former spellings as the pretraining recipe's (a recipe imports no other recipe)
            config.update(stored_config(obj, LinearProbeConfig, where=f"checkpoint {path}") or {})
        return moco_weights(obj, path)

    state, _ = read_moco_state(checkpoint, unwrap=unwrap)
    return state, config


def _pretrained_on(checkpoint: str) -> tuple[dict[str, Any], str]:
    """What `checkpoint` says about its pretraining data ({"kind", "root", "image_size"}, any of them absent),
    and the architecture: a trainlab run records its config; an official ViT's position table fixes its side."""
    if not checkpoint:
        return {}, ""
    state, config = _read_moco_checkpoint(checkpoint)
    arch = infer_arch(state, where=checkpoint)
    found: dict[str, Any] = {}
    data = config.get("data")
    # the data group, or (a run recorded before it; accepted until the next release) flat `data` and `data_root`
    kind, root = (data.get("kind"), data.get("root")) if isinstance(data, dict) else (data, config.get("data_root"))
    if kind in DATA_KINDS:
        found["kind"] = kind
    if isinstance(root, (str, Path)) and str(root):
        found["root"] = Path(root)
    if isinstance(config.get("image_size"), int):
        found["image_size"] = config["image_size"]
    if "image_size" in arch:  # a ViT: its position table is for this side only
        found["image_size"] = arch["image_size"]
    return found, str(arch["backbone"])


_FLAGS = {"kind": "--data.kind", "root": "--data.root", "image_size": "--image-size"}


def resolve_eval_data(checkpoint: str, data: ProbeData, image_size: int | None) -> tuple[ProbeData, int]:
    """The data and side to evaluate a backbone on: each setting given on the command line, else the checkpoint's,
    else the default (digits, data/cifar10, 16 px). The root is taken from the checkpoint only for the kind it was
    pretrained on (and said only for kinds read from a root).

    A given value that differs from the checkpoint's is used and said in a warning (a transfer evaluation is
    legitimate), except another side for a ViT, whose position table cannot take it.

    Returns:
        `data` with kind and root set, and the image side.

    Raises:
        UsageError: an unreadable checkpoint, a ViT side other than its own, or a side the data cannot take.
    """
    found, arch = _pretrained_on(checkpoint)
    if image_size is not None and arch.startswith("moco_vit") and image_size != found["image_size"]:
        raise UsageError(
            f"--image-size {image_size}: {checkpoint} is a {arch} whose position table is for {found['image_size']} "
            f"px inputs; leave --image-size out (or pass {found['image_size']})"
        )
    kind = data.kind or found.get("kind") or DEFAULT_KIND
    if kind != found.get("kind"):  # another data set: the pretraining root does not apply
        found.pop("root", None)
    given: dict[str, Any] = {"kind": data.kind, "root": data.root, "image_size": image_size}
    defaults: dict[str, Any] = {"kind": DEFAULT_KIND, "root": DEFAULT_ROOT, "image_size": DEFAULT_IMAGE_SIZE}
    values: dict[str, Any] = {}
    taken: list[str] = []
    for key, value in given.items():
        if value is not None:
            values[key] = value
            if key in found and value != found[key]:
                log.warning("%s was pretrained with %s %s; evaluating with %s %s as asked", checkpoint,
                            _FLAGS[key], found[key], _FLAGS[key], value)  # fmt: skip
        elif key in found:
            values[key] = found[key]
            if key != "root" or kind in ("image-folder", "cifar10"):  # digits and fake images read no root
                taken.append(f"{_FLAGS[key]} {found[key]}")
        else:
            values[key] = defaults[key]
    if taken:
        log.info("%s from the checkpoint %s", ", ".join(taken), checkpoint)
    check_image_size(values["kind"], values["image_size"])
    return dataclasses.replace(data, kind=values["kind"], root=values["root"]), values["image_size"]


@dataclasses.dataclass(kw_only=True)
class LinearProbeConfig(TrainConfig):
    """Linear classification on frozen MoCo v3 features (official main_lincls.py protocol)."""

    run_dir: Path = option(
        Path("runs/linear-probe"),
        "the run's folder: config, metrics, checkpoints; launched again, it resumes",
        metavar="DIR",
    )
    moco_weights: str = option(
        "",
        "MoCo weights: an official main_moco.py checkpoint or a trainlab run's ckpt/last.pt; '': random init",
        metavar="PATH",
        deprecated=("--checkpoint",),
    )
    model: MocoBackbone = option(
        "tv_resnet_debug",
        "backbone (registry name) when --moco-weights is '' (the random-init baseline)",
        deprecated=("--arch",),
        deprecated_values=FORMER_MOCO_BACKBONES,
    )
    data: ProbeData = option(ProbeData(), "which images (default: the backbone's pretraining data)")
    image_size: int | None = option(
        None, "input side (digits 8-32; official 224); default: the checkpoint's pretraining side, else 16", ge=1
    )
    augment: bool = option(True, "train RandomResizedCrop(S) + flip (cifar10, image-folder; digits and fake never)")
    optim: OptimConfig = option(
        OptimConfig(name="sgd", base_learning_rate=0.1, momentum=0.9, weight_decay=0.0),
        "official: SGD, momentum 0.9, no weight decay; base lr per 256 images (ResNet 0.1, ViT 3)",
    )
    batch_size: int = option(256, "global batch per optimizer step (official 1024)", gt=0)
    epochs: int = option(90, "number of epochs (official 90)", ge=1)
    schedule: ScheduleConfig = option(ScheduleConfig(kind="cosine"), "cosine decay, no warm-up (official)")
    log_every: int = option(50, "log training metrics every N optimizer steps", ge=1)
    eval_every_epochs: int = option(10, "evaluate every N epochs (and always after the last: the result)", ge=1)

    def validate(self) -> None:
        super().validate()
        # what is known before the checkpoint is read: the given values, or the defaults without a checkpoint
        kind = self.data.kind or (None if self.moco_weights else DEFAULT_KIND)
        size = self.image_size or (None if self.moco_weights else DEFAULT_IMAGE_SIZE)
        if size is not None:
            check_image_size(kind, size)
            if not self.moco_weights:
                check_vit_image_size(self.model, size)

    @property
    def side(self) -> int:
        """The input side, once resolved (`resolve_eval_data`)."""
        assert self.image_size is not None, "unresolved: see resolve_eval_data"
        return self.image_size


class LinearProbeRecipe(Recipe[LinearProbeConfig]):
    name = "linear-probe"
    config_class = LinearProbeConfig
    resume_may_change = ("data.root",)  # a moved dataset (another size is refused)

    def __init__(self, config: LinearProbeConfig) -> None:
        if config.data.kind is None or config.data.root is None or config.image_size is None:  # from the checkpoint
            data, side = resolve_eval_data(config.moco_weights, config.data, config.image_size)
            config = dataclasses.replace(config, data=data, image_size=side)
            config.validate()
        super().__init__(config)
        self._test: ImageSplit | None = None
        self._initial: dict[str, torch.Tensor] = {}
        self.source = ""

    def _transforms(self) -> tuple[RandomResizedCropFlip | ResizeCenterCrop, ResizeCenterCrop]:
        """(train, test) transforms: the official RandomResizedCrop + flip in training where it applies (CIFAR-10,
        image folders; not with --augment false), else Resize + CenterCrop (in-memory images: as they are)."""
        c = self.config
        kind = c.data.resolved().kind
        mean, std = normalisation(kind)
        plain = ResizeCenterCrop(c.side, mean, std)
        augmented = c.augment and kind in ("cifar10", "image-folder")
        return (RandomResizedCropFlip(c.side, mean, std) if augmented else plain), plain

    def _test_split(self) -> ImageSplit:
        if self._test is None:
            c = self.config
            test = open_split(c.data.resolved(), "eval", self._transforms()[1], seed=c.seed)
            if test is None:
                raise UsageError(f"the linear probe needs held-out images: {c.data.root}/val not found")
            self._test = test
        return self._test

    def num_classes(self) -> int:
        """K: the class folders of an image folder, 10 for the digits, CIFAR-10 and fake images."""
        return num_classes(self.config.data.resolved())

    def build(self, device: torch.device) -> TrainParts:
        c, side = self.config, self.config.side
        moco, self.source = load_backbone(c.moco_weights, c.model, side)
        backbone = Backbone(moco).to(device).eval()  # eval before any forward: train mode would move BN statistics
        self._initial = {k: v.detach().clone() for k, v in backbone.state_dict().items()}
        with torch.no_grad():
            width = backbone(torch.zeros(2, 3, side, side, device=device)).shape[1]
        classifier = nn.Linear(width, self.num_classes()).to(device)
        nn.init.normal_(classifier.weight, mean=0.0, std=0.01)
        nn.init.zeros_(classifier.bias)
        optimizer = c.optim.build(classifier.parameters(), batch_size=c.batch_size, device=device)
        return TrainParts(
            models={"classifier": classifier},
            phases=[Phase("main", optimizer, ["classifier"])],
            frozen={"backbone": backbone},
        )

    def build_data(self, parts: TrainParts, device: torch.device) -> Dataset[Batch]:
        c = self.config
        train = open_split(c.data.resolved(), "train", self._transforms()[0], seed=c.seed)
        assert train is not None
        self._test_split()  # a missing val/ fails now, not after the first epoch
        return train.images

    def example_batch(self, batch_size: int) -> Batch:
        s = self.config.side
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
        test = self._test_split().images
        folder = self.config.data.kind == "image-folder"  # decoded per image (loader workers); else in memory
        workers = self.config.num_workers if folder else 0
        batches = DataLoader(
            test,
            batch_size=256 if folder else 512,
            shuffle=False,
            num_workers=workers,
            worker_init_fn=ignore_stop_signals,
        )
        total = len(test)  # type: ignore[arg-type]
        dtype = next(classifier.parameters()).dtype
        correct = 0
        with torch.no_grad():
            for batch in batches:
                logits = classifier(backbone(batch["image"].to(device)).to(dtype))
                correct += int((logits.argmax(-1).cpu() == batch["label"]).sum())
        return {"test_accuracy": correct / total}

    def model_family(self) -> ModelFamily:
        return MOCO_BACKBONE_FAMILY[self.config.model]  # the frozen backbone's forward is most of the step

    def debug_config(self) -> LinearProbeConfig:
        return dataclasses.replace(
            self.config,
            data=dataclasses.replace(self.config.data, kind="digits", train_limit=256, eval_limit=256),
            image_size=16,
            batch_size=32,
            epochs=2,
        )
