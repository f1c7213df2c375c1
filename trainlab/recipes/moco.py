"""MoCo v3 self-supervised pretraining (facebookresearch/moco-v3 main_moco.py) on the shared engine.

What the engine adds to the official loop: one GPU or a CPU (keys are gathered only when distributed), any
precision mode, gradient accumulation, bit-exact resume, SIGTERM saving; torchrun DDP with SyncBatchNorm on CUDA.

The momentum update runs in `after_optimizer_step`, once per optimizer step: after step s it applies m(s + 1), the
update the official forward of iteration s + 1 applies between its queries and its keys (the base weights are the
same at both moments), so the losses are the official ones. Iteration 0's update (a no-op up to rounding) runs at
the start of step 0, and none runs after the last step, so the final weights are the official ones too.

Keys under accumulation or several processes (`--moco-keys`): `full-batch` (the default) scores every query against
the keys of the whole optimizer batch, every micro-batch of every process, as the official single large batch does
(`models/moco/batch_keys.py`: keys first, without gradient, then each micro-batch's queries); `micro-batch` against
its own micro-batch's keys only (on one process: a smaller-batch loss). Either way BatchNorm normalises each
micro-batch by its own statistics (the official SyncBatchNorm: the whole global batch's).

Learning rate: base x global batch / 256 (official), warm-up then cosine per iteration (the engine's schedule;
set `schedule.warmup_fraction` = warm-up epochs / epochs). Evaluation: weighted kNN (cosine, k=200, T=0.1) of the
base encoder's backbone features, held-out queries against the un-augmented training set (a bank and queries of at
most --data.eval-limit images each; on an image folder the monitor needs that limit, ImageNet's whole training set
is left to `trainlab eval knn`).
Shape legend: B batch, C channels, H/W pixels, N images, F feature width.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

import trainlab.models.moco.batch_keys as moco_batch_keys
from trainlab import dist
from trainlab.config import option
from trainlab.data.batch_views import adjust_views
from trainlab.data.config import (
    DataConfig,
    DataKind,
    check_image_size,
    eval_limit_option,
    kind_option,
    max_images,
    root_option,
    train_limit_option,
)
from trainlab.data.sources import EvalImages, eval_images, has_held_out_folder, normalisation, open_split
from trainlab.data.transforms import TwoViews
from trainlab.engine.recipe import Batch, Phase, Recipe, StepInfo, TrainConfig, TrainParts, unwrap_model
from trainlab.engine.schedule import ScheduleConfig
from trainlab.errors import UsageError
from trainlab.evaluate.features import extract_features
from trainlab.evaluate.knn import knn_accuracy
from trainlab.models.backbones.vit import check_vit_image_size
from trainlab.models.moco import MoCo, is_vit, official_checkpoint
from trainlab.models.names import FORMER_MOCO_BACKBONES, MOCO_BACKBONE_FAMILY, MocoBackbone, ModelFamily
from trainlab.optim.config import OptimConfig
from trainlab.optim.momentum import cosine_momentum
from trainlab.recipes.moco_plan import accumulation_lever_effect, moco_plan_notes


@dataclasses.dataclass(kw_only=True)
class MocoData(DataConfig):
    """MoCo's images: CIFAR-10 (the default), an ImageNet-layout folder (the official runs), the bundled digits or
    fake images, through `two_views` for training and `normalise` for the kNN monitor."""

    kind: DataKind = kind_option("cifar10", DataKind, deprecated=("--data",))
    root: Path = root_option(Path("data/cifar10"), DataKind, deprecated=("--data-root",))
    train_limit: int = train_limit_option(deprecated=("--train-subset",))
    eval_limit: int = eval_limit_option(
        0, "images each in the kNN monitor's bank (training split) and queries (held-out split); image-folder: "
        "0 turns the monitor off", deprecated=("--eval-subset",),
    )  # fmt: skip


@dataclasses.dataclass(kw_only=True)
class MocoConfig(TrainConfig):
    """MoCo v3 pretraining of a ResNet or ViT (official defaults: ResNet-50, LARS, T 1.0; see configs/moco_*)."""

    run_dir: Path = option(
        Path("runs/moco"), "the run's folder: config, metrics, checkpoints; launched again, it resumes", metavar="DIR"
    )
    model: MocoBackbone = option(
        "tv_resnet18_cifar",
        "backbone (registry name): torchvision ResNets tv_*, MoCo v3 ViTs moco_vit_*",
        deprecated=("--arch",),
        deprecated_values=FORMER_MOCO_BACKBONES,
    )
    data: MocoData = option(MocoData(), "which images")
    image_size: int = option(32, "view side in pixels (official 224; CIFAR 32; digits 8-32)", ge=1)
    crop_min: float = option(
        0.08, "smallest RandomResizedCrop area fraction (official --crop-min: R50 0.2, ViT 0.08)", gt=0, le=1
    )
    blur: bool = option(True, "Gaussian blur p 1.0 / 0.1 on the views (off for CIFAR-size images)")
    augment_device: str = option(
        "cpu",
        "where the views' colour jitter, greyscale, blur, solarize and flip run: cpu (the loader workers, per image) "
        "or cuda (the run's GPU, batched: the workers crop, resize and draw, the 8-bit crops are copied); the same "
        "draws either way",
        metavar="cpu|cuda|cuda:N",
    )
    projection_dim: int = option(256, "output width of projector and predictor (official --moco-dim)", ge=1)
    mlp_hidden_dim: int = option(4096, "hidden width of projector and predictor (official --moco-mlp-dim)", ge=1)
    temperature: float = option(1.0, "softmax temperature (official --moco-t: ResNet 1.0, ViT 0.2)", gt=0)
    momentum: float = option(0.99, "momentum-encoder coefficient m0 (official --moco-m; 1: frozen keys)", ge=0, le=1)
    momentum_cosine: bool = option(True, "cosine schedule of m from m0 to 1 per iteration (official --moco-m-cos)")
    stop_grad_conv1: bool = option(False, "ViT: keep the patch projection at its random init (--stop-grad-conv1)")
    optim: OptimConfig = option(
        OptimConfig(name="lars", base_learning_rate=0.6, momentum=0.9, weight_decay=1e-6),
        "official: lars (ResNet) or adamw (ViT); base lr per 256 images (--lr), lr = base x batch_size / 256; "
        "weight decay (--wd) LARS 1e-6, AdamW 0.1",
    )
    sync_batchnorm: bool = option(True, "SyncBatchNorm when distributed on CUDA (as the official code)")
    batch_size: int = option(512, "global batch per optimizer step (official 4096)", gt=0)
    moco_keys: moco_batch_keys.MocoKeys = option(
        "full-batch",
        "keys each query is scored against when the batch is split over micro-batches or processes: full-batch (those "
        "of the whole optimizer batch: the large batch's loss) or micro-batch (its own micro-batch's only)",
    )
    epochs: int = option(100, "number of epochs", ge=1)
    schedule: ScheduleConfig = option(
        ScheduleConfig(kind="cosine", warmup_fraction=0.1), "per-iteration warm-up (fraction of steps) then cosine"
    )
    knn_k: int = option(200, "kNN monitor: neighbours", ge=1)
    knn_temperature: float = option(
        0.1, "kNN monitor: temperature of the exp(similarity / T) vote (below 0.02 it overflows float32)", ge=0.02
    )
    eval_batch_size: int = option(256, "batch size of the feature extraction", ge=1)

    @classmethod
    def unrecorded(cls, stored: Mapping[str, Any]) -> dict[str, Any]:
        """Before --moco-keys existed, a batch split over micro-batches scored each one against its own keys only."""
        accumulation = stored.get("grad_accumulation", 1)
        return {"moco_keys": "micro-batch"} if isinstance(accumulation, int) and accumulation > 1 else {}

    def validate(self) -> None:
        super().validate()
        check_image_size(self.data.kind, self.image_size)
        check_vit_image_size(self.model, self.image_size)
        check_knn_k(self.knn_k, "--knn-k", self.data.kind, self.data.eval_limit)
        check_augment_device(self.augment_device, self.device)


def check_augment_device(augment_device: str, device: str) -> None:
    """Refuse an --augment-device that is not the CPU or a CUDA device, or a GPU for a --device cpu run (whether this
    machine has CUDA is checked when the run starts, `MocoRecipe.build_data`: a plan may be made without it).

    Raises:
        UsageError: one line naming the value and the fix.
    """
    index = augment_device.removeprefix("cuda:")
    if augment_device not in ("cpu", "cuda") and not (index != augment_device and index.isdigit()):
        raise UsageError(f"unknown --augment-device {augment_device!r}; use cpu, cuda or cuda:N (the run's GPU)")
    if augment_device != "cpu" and device == "cpu":
        raise UsageError(f"--augment-device {augment_device} with --device cpu; use --augment-device cpu")


def check_views_device(augment_device: str, device: torch.device) -> None:
    """Refuse batched views on a device other than the run's CUDA device (no CUDA here, a CPU run, another GPU).

    Raises:
        UsageError: one line naming the value and the fix.
    """
    if augment_device == "cpu" or (device.type == "cuda" and augment_device in ("cuda", str(device))):
        return
    if not torch.cuda.is_available():
        raise UsageError(f"--augment-device {augment_device} needs a CUDA GPU and none is visible; use cpu")
    raise UsageError(f"--augment-device {augment_device} is not the run's device {device}; use cuda or cpu")


def check_knn_k(k: int, k_flag: str, kind: str | None, eval_limit: int) -> None:
    """Refuse more kNN neighbours than the bank can hold, where a bound on its size is known before any image is
    read (the bundled digits' 4,000 training images, or --data.eval-limit): otherwise the run would fail at its first
    evaluation, after a whole epoch.

    Raises:
        UsageError: `k` exceeds the bank.
    """
    bound = max_images(kind, "train", eval_limit, "--data.eval-limit")
    if bound is not None and k > bound[0]:
        raise UsageError(f"{k_flag}: k={k} must be between 1 and the bank size {bound[0]} ({bound[1]}); lower {k_flag}")


def knn_of_features(
    features: Any,
    images: EvalImages,
    *,
    device: torch.device,
    batch_size: int,
    k: int,
    temperature: float,
    k_flag: str = "--knn-k",
) -> float:
    """kNN accuracy of the queries against the bank under the feature map `features`."""
    bank_NF = extract_features(features, images.bank_N3HW, batch_size=batch_size, device=device)
    query_NF = extract_features(features, images.query_N3HW, batch_size=batch_size, device=device)
    return knn_accuracy(
        query_NF,
        images.query_labels_N,
        bank_NF,
        images.bank_labels_N.to(device),
        num_classes=images.num_classes,
        k=k,
        temperature=temperature,
        k_flag=k_flag,
    )


log = logging.getLogger(__name__)


def log_keys(c: MocoConfig, world: int, sync_batchnorm: bool) -> None:
    """Log what a query is scored against and what BatchNorm normalises by, when the batch is split."""
    split = world * c.grad_accumulation
    if split == 1:
        return
    keys = c.batch_size if c.moco_keys == "full-batch" else c.batch_size // split
    normalised = c.batch_size // c.grad_accumulation if sync_batchnorm else c.batch_size // split
    log.info(
        "--moco-keys %s: each query against %d keys (the optimizer batch: %d); BatchNorm statistics of %d images%s",
        c.moco_keys,
        keys,
        c.batch_size,
        normalised,
        "" if normalised == c.batch_size else " (the logits are the large batch's up to BatchNorm)",
    )


def _unwrap(model: nn.Module) -> MoCo:
    inner = unwrap_model(model)
    assert isinstance(inner, MoCo), type(inner)
    return inner


class MocoRecipe(Recipe[MocoConfig]):
    name = "moco"
    config_class = MocoConfig
    resume_may_change = (
        *("data.root", "knn_k", "knn_temperature", "data.eval_limit", "eval_batch_size"),  # the kNN monitor
        "augment_device",  # the same draws, float rounding apart
    )
    last_step_repeats_previous = False  # no momentum update after the last step (`after_optimizer_step`)

    def __init__(self, config: MocoConfig) -> None:
        super().__init__(config)
        self._eval_images: EvalImages | None = None
        self._step_keys: moco_batch_keys.OptimizerBatchKeys | None = (
            None  # full-batch keys of the current optimizer step
        )
        self.batched_views = config.augment_device != "cpu"  # the views finished in `prepare_batch`
        self._views: TwoViews | None = None

    def build(self, device: torch.device) -> TrainParts:
        c = self.config
        model = MoCo(
            c.model,
            dim=c.projection_dim,
            mlp_dim=c.mlp_hidden_dim,
            temperature=c.temperature,
            image_size=c.image_size,
            stop_grad_conv1=c.stop_grad_conv1,
        )
        if dist.world_size() > 1:
            model.gather_keys = dist.gather_keys
            if c.sync_batchnorm and device.type == "cuda":
                model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        if c.moco_keys == "micro-batch":  # each process's (micro-)batch against its own keys only: no gather
            _unwrap(model).gather_keys = moco_batch_keys.local_keys
        log_keys(c, dist.world_size(), dist.world_size() > 1 and c.sync_batchnorm and device.type == "cuda")
        model = model.to(device)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = c.optim.build(params, batch_size=c.batch_size, device=device)
        return TrainParts(
            models={"moco": model},
            phases=[Phase("main", optimizer, ["moco"])],
            shard_units={"moco": _unwrap(model).shard_units()},
        )

    def build_data(self, parts: TrainParts, device: torch.device) -> Dataset[Batch]:
        c = self.config
        mean, std = normalisation(c.data.kind)
        check_views_device(c.augment_device, device)
        views = TwoViews(
            image_size=c.image_size, crop_min=c.crop_min, blur=c.blur, mean=mean, std=std, deferred=self.batched_views
        )
        self._views = views
        train = open_split(c.data, "train", views, seed=c.seed)
        assert train is not None
        self._check_monitor(train.total)
        return train.images

    def _check_monitor(self, train_images: int) -> None:
        """What the kNN monitor's first evaluation would refuse, refused before the first epoch: a folder's missing
        or mismatched val/, a k above the bank's size (min(--data.eval-limit, the training images))."""
        c = self.config
        if not self._monitors:
            return
        if c.data.kind == "image-folder" and not has_held_out_folder(c.data):
            raise UsageError(
                f"the kNN monitor (--data.eval-limit {c.data.eval_limit}) needs held-out images: {c.data.root / 'val'} "
                "not found; add it, or pass --data.eval-limit 0"
            )
        bank = min(c.data.eval_limit, train_images) if c.data.eval_limit > 0 else train_images
        if c.knn_k > bank:
            raise UsageError(
                f"--knn-k: k={c.knn_k} must be between 1 and the kNN monitor's bank size {bank} (the training images"
                f"{', at most --data.eval-limit' if c.data.eval_limit > 0 else ''}); lower --knn-k"
            )

    @property
    def _monitors(self) -> bool:
        """Whether `evaluate` runs the kNN monitor (a folder's only with --data.eval-limit > 0)."""
        return not (self.config.data.kind == "image-folder" and self.config.data.eval_limit <= 0)

    def prepare_batch(self, batch: Batch) -> Batch:
        """--augment-device cuda: the views' adjustments, batched on the device (`trainlab.data.batch_views`)."""
        if not self.batched_views:
            return batch
        assert self._views is not None, "build_data did not run"
        return adjust_views(batch, self._views)

    def example_batch(self, batch_size: int) -> Batch:
        s = self.config.image_size
        return {
            "view1": torch.zeros(batch_size, 3, s, s),
            "view2": torch.zeros(batch_size, 3, s, s),
            "label": torch.zeros(batch_size, dtype=torch.long),
        }

    def momentum_at(self, step: int, total_steps: int) -> float:
        """m of iteration `step` (official `adjust_moco_momentum` when cosine, else m0)."""
        c = self.config
        return cosine_momentum(step, total_steps, c.momentum) if c.momentum_cosine else c.momentum

    def has_first_pass(self, phase: str, info: StepInfo) -> bool:
        """Full-batch keys of a step split into micro-batches: the keys of every micro-batch come first."""
        return self.config.moco_keys == "full-batch" and info.num_micro_steps > 1

    def first_pass(
        self, models: Mapping[str, nn.Module], micro_batches: Iterable[Batch], phase: str, info: StepInfo
    ) -> None:
        """The momentum update of step 0 (later steps': after the previous step), then the optimizer batch's keys."""
        model = _unwrap(models["moco"])
        if info.step == 0:  # iteration 0's update (the official forward runs it too)
            model.update_momentum_encoder(self.momentum_at(0, info.total_steps))
        views = ((batch["view1"], batch["view2"]) for batch in micro_batches)
        self._step_keys = moco_batch_keys.optimizer_batch_keys(model.momentum_encoder, views, model.gather_keys)

    def train_step(self, models: Mapping[str, nn.Module], batch: Batch, phase: str, info: StepInfo) -> dict[str, Any]:
        if self.has_first_pass(phase, info):
            assert self._step_keys is not None, "first_pass did not run"
            keys = self._step_keys.of_micro_batch(info.micro_step)
            if info.micro_step == info.num_micro_steps - 1:
                self._step_keys = None  # the last micro-batch: the keys are not kept past the step
            return {"loss": models["moco"](batch["view1"], batch["view2"], keys=keys)}
        if info.step == 0 and info.micro_step == 0:  # iteration 0's update (the official forward runs it too)
            _unwrap(models["moco"]).update_momentum_encoder(self.momentum_at(0, info.total_steps))
        loss = models["moco"](batch["view1"], batch["view2"])
        return {"loss": loss}

    def after_optimizer_step(self, models: Mapping[str, nn.Module], phase: str, info: StepInfo) -> dict[str, float]:
        next_step = info.step + 1
        if next_step >= info.total_steps:  # the official loop ends here: no update after the last step
            return {}
        momentum = self.momentum_at(next_step, info.total_steps)
        _unwrap(models["moco"]).update_momentum_encoder(momentum)
        return {"moco_momentum": momentum}

    def evaluate(self, models: Mapping[str, nn.Module], device: torch.device, epoch: int) -> dict[str, float]:
        c = self.config
        if not self._monitors:
            return {}  # a kNN bank of a whole ImageNet-size folder is left to `trainlab eval knn`
        if self._eval_images is None:
            self._eval_images = eval_images(c.data, c.image_size)
        model = _unwrap(models["moco"])
        dtype = next(model.parameters()).dtype
        acc = knn_of_features(
            lambda x: model.features(x.to(dtype)),
            self._eval_images,
            device=device,
            batch_size=c.eval_batch_size,
            k=c.knn_k,
            temperature=c.knn_temperature,
        )
        return {"knn_accuracy": acc}

    def on_fit_end(self, models: Mapping[str, nn.Module]) -> None:
        """Writes `checkpoint_official.pth.tar` (main_moco.py's format, for main_lincls.py --pretrained)."""
        model = _unwrap(models["moco"])
        state = official_checkpoint(model, epoch=self.config.epochs)
        state["state_dict"] = {k: v.detach().cpu() for k, v in state["state_dict"].items()}
        torch.save(state, self.config.run_dir / "checkpoint_official.pth.tar")

    def model_family(self) -> ModelFamily:
        return MOCO_BACKBONE_FAMILY[self.config.model]

    def plan_notes(self, gpus: int, accumulation: int, micro_batch: int) -> list[str]:
        return moco_plan_notes(self.config, gpus, accumulation, micro_batch)

    def accumulation_note(self, gpus: int, accumulation: int) -> str:
        return accumulation_lever_effect(self.config, gpus, accumulation)

    def debug_config(self) -> MocoConfig:
        return dataclasses.replace(
            self.config,
            model="moco_vit_debug" if is_vit(self.config.model) else "tv_resnet_debug",
            data=dataclasses.replace(self.config.data, kind="digits", train_limit=128, eval_limit=128),
            image_size=16,
            crop_min=0.2,
            blur=False,
            projection_dim=16,
            mlp_hidden_dim=64,
            batch_size=16,
            epochs=2,
            knn_k=20,
            eval_batch_size=64,
        )
