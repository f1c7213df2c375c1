"""MoCo v3 self-supervised pretraining (facebookresearch/moco-v3 main_moco.py) on the shared engine.

What the engine adds to the official loop: one GPU or a CPU (keys are gathered only when distributed), any
precision mode, gradient accumulation, bit-exact resume, SIGTERM saving; torchrun DDP with SyncBatchNorm on CUDA.

The momentum update runs in `after_optimizer_step`, once per optimizer step: after step s it applies m(s + 1), the
update the official forward of iteration s + 1 applies between its queries and its keys (the base weights are the
same at both moments), so the losses are the official ones. Iteration 0's update (a no-op up to rounding) runs at
the start of step 0, and none runs after the last step, so the final weights are the official ones too.

Learning rate: base x global batch / 256 (official), warm-up then cosine per iteration (the engine's schedule;
set `schedule.warmup_fraction` = warm-up epochs / epochs). Evaluation: weighted kNN (cosine, k=200, T=0.1) of the
base encoder's backbone features, held-out queries against the un-augmented training set.
Shape legend: B batch, C channels, H/W pixels, N images, F feature width.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.data import Dataset

from trainlab import dist
from trainlab.config import option
from trainlab.data.ssl_views import HALF, IMAGENET_MEAN, IMAGENET_STD, TensorTwoViews, ViewSpec, normalise
from trainlab.engine.recipe import Batch, Phase, Recipe, StepInfo, TrainConfig, TrainParts, unwrap_model
from trainlab.engine.schedule import ScheduleConfig
from trainlab.errors import UsageError
from trainlab.evaluate.knn import extract_features, knn_accuracy
from trainlab.models.moco import MOCO_ARCHS, MoCo, MocoArch, cosine_momentum, official_checkpoint
from trainlab.optim import LARS

SslData = Literal["digits", "cifar10", "image-folder"]
OptimizerName = Literal["lars", "adamw"]


@dataclasses.dataclass(kw_only=True)
class MocoConfig(TrainConfig):
    """MoCo v3 pretraining of a ResNet or ViT (official defaults: ResNet-50, LARS, T 1.0; see configs/moco_*)."""

    run_dir: Path = option(Path("runs/moco"), "output directory")
    arch: MocoArch = option("resnet18_cifar", "backbone: " + ", ".join(MOCO_ARCHS))
    data: SslData = option("cifar10", "digits (bundled, CPU), cifar10 (data_root/cifar-10-batches-py) or image-folder")
    data_root: Path = option(
        Path("data/cifar10"), "cifar10: folder with cifar-10-batches-py/; image-folder: train/, val/"
    )
    train_subset: int = option(0, "N > 0: train on the first N training images only (0: all)", ge=0)
    image_size: int = option(32, "view side in pixels (official 224; CIFAR 32; digits 8-32)", ge=1)
    crop_min: float = option(
        0.08, "smallest RandomResizedCrop area fraction (official --crop-min: R50 0.2, ViT 0.08)", gt=0, le=1
    )
    blur: bool = option(True, "Gaussian blur p 1.0 / 0.1 on the views (off for CIFAR-size images)")
    projection_dim: int = option(256, "output width of projector and predictor (official --moco-dim)", ge=1)
    mlp_hidden_dim: int = option(4096, "hidden width of projector and predictor (official --moco-mlp-dim)", ge=1)
    temperature: float = option(1.0, "softmax temperature (official --moco-t: ResNet 1.0, ViT 0.2)", gt=0)
    momentum: float = option(0.99, "momentum-encoder coefficient m0 (official --moco-m; 1: frozen keys)", ge=0, le=1)
    momentum_cosine: bool = option(True, "cosine schedule of m from m0 to 1 per iteration (official --moco-m-cos)")
    stop_grad_conv1: bool = option(False, "ViT: keep the patch projection at its random init (--stop-grad-conv1)")
    optimizer: OptimizerName = option("lars", "lars (ResNet) or adamw (ViT)")
    base_learning_rate: float = option(0.6, "learning rate per 256 images; lr = base x batch_size / 256 (--lr)", gt=0)
    weight_decay: float = option(1e-6, "weight decay (official --wd: LARS 1e-6, AdamW 0.1)", ge=0)
    optimizer_momentum: float = option(0.9, "LARS momentum", ge=0, lt=1)
    sync_batchnorm: bool = option(True, "SyncBatchNorm when distributed on CUDA (as the official code)")
    batch_size: int = option(512, "global batch per optimizer step (official 4096)", gt=0)
    epochs: int = option(100, "number of epochs", ge=1)
    schedule: ScheduleConfig = option(
        ScheduleConfig(kind="cosine", warmup_fraction=0.1), "per-iteration warm-up (fraction of steps) then cosine"
    )
    knn_k: int = option(200, "kNN monitor: neighbours", ge=1)
    knn_temperature: float = option(
        0.1, "kNN monitor: temperature of the exp(similarity / T) vote (below 0.02 it overflows float32)", ge=0.02
    )
    eval_subset: int = option(
        0, "N > 0: kNN bank and queries use the first N images of each split (debug; 0: all)", ge=0
    )
    eval_batch_size: int = option(256, "batch size of the feature extraction", ge=1)

    def validate(self) -> None:
        super().validate()
        check_image_size(self.data, self.image_size, self.arch)
        check_knn_k(self.knn_k, "--knn-k", self.data, self.eval_subset, "--eval-subset")


def check_image_size(data: SslData, image_size: int, arch: str | None) -> None:
    """Refuse an image side the data or the backbone cannot take (digits 8-32 px; a ViT's side divides by its patch).

    Args:
        data: the data set.
        image_size: the input side (--image-size).
        arch: the backbone that will be built at that size, or None when it comes from a checkpoint.

    Raises:
        UsageError: one line naming --image-size and the sizes that work.
    """
    from trainlab.data.digits import MAX_RESOLUTION, MIN_RESOLUTION
    from trainlab.models.moco.vit import VIT_SIZES

    if data == "digits" and not MIN_RESOLUTION <= image_size <= MAX_RESOLUTION:
        raise UsageError(f"digits are {MIN_RESOLUTION} to {MAX_RESOLUTION} px; got --image-size {image_size}")
    vit = VIT_SIZES.get(arch or "")
    if vit is not None and (image_size % vit.patch_size or image_size < vit.patch_size):
        raise UsageError(
            f"--arch {arch} cuts images into {vit.patch_size}-px patches: --image-size must be a multiple of "
            f"{vit.patch_size}, got {image_size}"
        )


def check_knn_k(k: int, k_flag: str, data: SslData, subset: int, subset_flag: str) -> None:
    """Refuse more kNN neighbours than the bank can hold, where a bound on its size is known before any image is
    read (the bundled digits' 4,000 training images, or a subset): otherwise the run would fail at its first
    evaluation, after a whole epoch.

    Raises:
        UsageError: `k` exceeds the bank.
    """
    from trainlab.data.digits import NUM_CLASSES, TRAIN_PER_CLASS

    full = NUM_CLASSES * TRAIN_PER_CLASS if data == "digits" else None
    sizes = [n for n in (full, subset if subset > 0 else None) if n is not None]
    if sizes and k > min(sizes):
        bank = min(sizes)
        why = f"{subset_flag} {subset}" if bank == subset else f"the training images of {data}"
        raise UsageError(f"{k_flag}: k={k} must be between 1 and the bank size {bank} ({why}); lower {k_flag}")


@dataclasses.dataclass
class EvalImages:
    """Normalised, un-augmented images of a kNN bank (training split) and its queries (held-out split)."""

    bank_N3HW: torch.Tensor
    bank_labels_N: torch.Tensor
    query_N3HW: torch.Tensor
    query_labels_N: torch.Tensor
    num_classes: int


def _first(n: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(t[:n] if n > 0 else t for t in tensors)


def load_train_images(data: SslData, data_root: Path, image_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Training images in [0, 1] (or uint8), (N, 3, H, W), and labels: digits at `image_size`, CIFAR-10 at 32."""
    if data == "digits":
        from trainlab.data.digits import load_digits_dataset

        train = load_digits_dataset(resolution=image_size, split="train", seed=seed)
        return train.images_N3HW.add(1.0).div(2.0), train.labels_N
    if data == "cifar10":
        from trainlab.data.cifar import load_cifar10

        raw = load_cifar10(data_root, train=True)
        return torch.from_numpy(raw.data).permute(0, 3, 1, 2).contiguous(), torch.tensor(raw.targets)
    raise UsageError(f"load_train_images has no in-memory form for {data!r}")


def normalisation(data: SslData) -> tuple[tuple[float, float, float], tuple[float, float, float]]:
    """(mean, std) of the inputs: digits [-1, 1], CIFAR-10 its statistics, image folders ImageNet's."""
    if data == "digits":
        return HALF, HALF
    if data == "cifar10":
        from trainlab.data.cifar import CIFAR10_MEAN, CIFAR10_STD

        return CIFAR10_MEAN, CIFAR10_STD
    return IMAGENET_MEAN, IMAGENET_STD


def load_eval_images(data: SslData, data_root: Path, image_size: int, seed: int, subset: int = 0) -> EvalImages:
    """Bank (training split) and queries (held-out split), normalised as in training, no augmentation.

    digits: 4,000 train / 1,000 held-out; CIFAR-10: 50,000 train / 10,000 test; image folders: train/ and val/ at
    `image_size` (resize 1.143x + centre crop); `subset` > 0 keeps the first `subset` of each.
    """
    mean, std = normalisation(data)
    if data == "digits":
        from trainlab.data.digits import load_digits_dataset

        bank = load_digits_dataset(resolution=image_size, split="train", seed=seed)
        query = load_digits_dataset(resolution=image_size, split="heldout", seed=seed)
        b_img, b_lab, q_img, q_lab = bank.images_N3HW, bank.labels_N, query.images_N3HW, query.labels_N
        b_img, q_img = b_img.add(1.0).div(2.0), q_img.add(1.0).div(2.0)
        num_classes = 10
    elif data == "cifar10":
        from trainlab.data.cifar import load_cifar10

        train, test = load_cifar10(data_root, train=True), load_cifar10(data_root, train=False)
        b_img = torch.from_numpy(train.data).permute(0, 3, 1, 2)
        q_img = torch.from_numpy(test.data).permute(0, 3, 1, 2)
        b_lab, q_lab = torch.tensor(train.targets), torch.tensor(test.targets)
        num_classes = 10
    else:
        from trainlab.data.image_folder import ImageFolderDataset

        parts = []
        for split in ("train", "val"):
            folder = ImageFolderDataset(data_root / split, image_size=image_size, train=False)
            n = len(folder) if subset <= 0 else min(subset, len(folder))
            step = max(len(folder) // n, 1)
            items = [folder[i] for i in range(0, step * n, step)]
            imgs = torch.stack([it["image"] for it in items]).add(1.0).div(2.0)
            parts.append((imgs, torch.stack([it["label"] for it in items]), folder.num_classes))
        (b_img, b_lab, num_classes), (q_img, q_lab, _) = parts
    b_img, b_lab = _first(subset, b_img, b_lab)
    q_img, q_lab = _first(subset, q_img, q_lab)
    return EvalImages(normalise(b_img, mean, std), b_lab.long(), normalise(q_img, mean, std), q_lab.long(), num_classes)


def knn_of_features(
    features: Any, images: EvalImages, *, device: torch.device, batch_size: int, k: int, temperature: float
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
    )


def _unwrap(model: nn.Module) -> MoCo:
    inner = unwrap_model(model)
    assert isinstance(inner, MoCo), type(inner)
    return inner


class MocoRecipe(Recipe[MocoConfig]):
    name = "moco"
    config_class = MocoConfig
    resume_may_change = ("data_root", "knn_k", "knn_temperature", "eval_subset", "eval_batch_size")  # kNN monitor
    supports_activation_checkpointing = True  # per ViT block / per ResNet stage

    def __init__(self, config: MocoConfig) -> None:
        super().__init__(config)
        self._eval_images: EvalImages | None = None

    def learning_rate(self) -> float:
        """The official linear scaling: base x global batch / 256."""
        return self.config.base_learning_rate * self.config.batch_size / 256

    def build(self, device: torch.device) -> TrainParts:
        c = self.config
        model = MoCo(
            c.arch,
            dim=c.projection_dim,
            mlp_dim=c.mlp_hidden_dim,
            temperature=c.temperature,
            image_size=c.image_size,
            stop_grad_conv1=c.stop_grad_conv1,
        )
        model.set_activation_checkpointing(c.activation_checkpointing)
        if dist.world_size() > 1:
            model.gather_keys = dist.gather_keys
            if c.sync_batchnorm and device.type == "cuda":
                model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        model = model.to(device)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer: torch.optim.Optimizer
        if c.optimizer == "lars":
            optimizer = LARS(params, self.learning_rate(), weight_decay=c.weight_decay, momentum=c.optimizer_momentum)
        else:
            optimizer = torch.optim.AdamW(params, self.learning_rate(), weight_decay=c.weight_decay)
        return TrainParts(models={"moco": model}, phases=[Phase("main", optimizer, ["moco"])])

    def build_data(self, parts: TrainParts, device: torch.device) -> Dataset[Batch]:
        c = self.config
        mean, std = normalisation(c.data)
        spec = ViewSpec(image_size=c.image_size, crop_min=c.crop_min, blur=c.blur, mean=mean, std=std)
        if c.data == "image-folder":
            from trainlab.data.ssl_views import FolderTwoViews

            return FolderTwoViews(c.data_root / "train", spec, seed=c.seed)
        images, labels = load_train_images(c.data, c.data_root, c.image_size, c.seed)
        images, labels = _first(c.train_subset, images, labels)
        return TensorTwoViews(images, labels, spec, seed=c.seed)

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

    def train_step(self, models: Mapping[str, nn.Module], batch: Batch, phase: str, info: StepInfo) -> dict[str, Any]:
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
        if c.data == "image-folder" and c.eval_subset <= 0:
            return {}  # a kNN bank of a whole ImageNet-size folder is left to `trainlab eval knn`
        if self._eval_images is None:
            self._eval_images = load_eval_images(c.data, c.data_root, c.image_size, c.seed, c.eval_subset)
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

    def debug_config(self) -> MocoConfig:
        vit = self.config.arch.startswith("vit")
        return dataclasses.replace(
            self.config,
            arch="vit_debug" if vit else "resnet_debug",
            data="digits",
            train_subset=128,
            image_size=16,
            crop_min=0.2,
            blur=False,
            projection_dim=16,
            mlp_hidden_dim=64,
            batch_size=16,
            epochs=2,
            eval_subset=128,
            knn_k=20,
            eval_batch_size=64,
        )
