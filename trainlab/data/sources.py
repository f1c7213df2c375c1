"""The one dispatcher from a data config to a dataset: `open_split(cfg.data, split, transform)`, used by every recipe
and by `trainlab eval`.

A split is "train" or "eval" (the held-out images: an image folder's val/, CIFAR-10's test batch, the digits'
held-out 1,000, a fake set drawn apart from the training one). Where the images come from is the data kind
(`trainlab.data.config`); what is done to each image is the transform (`trainlab.data.transforms`):

    kind                 read as                                      limit (--data.train-limit / --data.eval-limit)
    image-folder         files, decoded per sample (`image_folder`)   N evenly spaced over the class-sorted listing
    cifar10              uint8 arrays in memory (`cifar`)             the first N
    digits               float images in [-1, 1] in memory, made at   the first N (their order is mixed already)
                         the transform's side
    fake                 uint8 images in memory (`synthetic`), made   the first N (labels are shuffled)
                         at the transform's side; or written in
                         CIFAR-10's format and read back (`fake_files`)

    transform                 image folder                  in-memory images
    VarResizeCrop             ImageFolderDataset            TensorImageDataset (made at side R: the flip only)
    TwoViews                  FolderTwoViews                TensorTwoViews
    RandomResizedCropFlip     ResizedCropFolder (train)     ResizedCropTensors
    ResizeCenterCrop          ResizedCropFolder (eval)      normalised as they are (their own side)
    PadCropFlip               -                             CifarAugmentDataset (uint8 images: CIFAR-10, fake)
    Normalise                 VAR centre crop, normalised   normalised as they are

`normalisation(kind)` gives the mean / std that fits a kind; `stacked(split)` the whole split as two tensors (a kNN
bank). An image folder without val/ has no eval split (`open_split` returns None and says so once).

Shape legend: N images, 3/H/W channels and side.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch.utils.data import DataLoader, Dataset

from trainlab.data.config import DataConfig, Split, accepted_kinds, fake_eval_size
from trainlab.data.image_folder import ImageFolderDataset, list_classes, scan_image_folder
from trainlab.data.resized_crops import ResizedCropFolder, ResizedCropTensors
from trainlab.data.ssl_views import FolderTwoViews, TensorTwoViews
from trainlab.data.tensors import MapImage, NamedTensorDataset, TensorImageDataset
from trainlab.data.transforms import (
    HALF,
    IMAGENET_MEAN,
    IMAGENET_STD,
    Normalise,
    RandomResizedCropFlip,
    ResizeCenterCrop,
    Stats,
    Transform,
    TwoViews,
    VarResizeCrop,
    normalise,
)
from trainlab.errors import UsageError

log = logging.getLogger(__name__)

Batch = dict[str, torch.Tensor]

DIGITS_SPLIT_SEED = 0  # one fixed train / held-out split: pretraining never sees a probe's test images
FAKE_SEED = 0  # kind fake is one data set too: the same images whatever the run's seed


@dataclass
class ImageSplit:
    """One split as a dataset, with its class count and what identifies its content.

    Attributes:
        images: the dataset; its samples are dicts of named tensors (the transform decides which).
        num_classes: classes of the data (the class folders of an image folder; 10 for CIFAR-10 and the digits; the
            requested count for fake images).
        description: JSON-able identity of the content (kind, size, side, ...; for a folder a hash of its listing),
            e.g. for a token cache's fingerprint.
        total: the split's images before any limit (`len(images)` is at most this).
    """

    images: Dataset[Batch]
    num_classes: int
    description: dict[str, Any]
    total: int


def normalisation(kind: str) -> tuple[Stats, Stats]:
    """(mean, std) of [0, 1] inputs of a data kind: digits and fake [-1, 1] images' (0.5), CIFAR-10 its statistics,
    image folders ImageNet's."""
    if kind in ("digits", "fake"):
        return HALF, HALF
    if kind == "cifar10":
        from trainlab.data.cifar import CIFAR10_MEAN, CIFAR10_STD

        return CIFAR10_MEAN, CIFAR10_STD
    return IMAGENET_MEAN, IMAGENET_STD


def open_split(
    data: DataConfig,
    split: Split,
    transform: Transform,
    *,
    seed: int = 0,
    fake_classes: int = 10,
    fake_files: Path | None = None,
    limit: int | None = None,
) -> ImageSplit | None:
    """The `split` of the images `data` selects, through `transform`.

    Args:
        data: the data group of a config (kind, root, limits, fake-set size, download).
        split: "train" or "eval"; `data.train_limit` / `data.eval_limit` cap its size.
        transform: what is done to each image (a spec of `trainlab.data.transforms`).
        seed: the augmentation seed: random crops, flips and views are a pure function of (seed, epoch, index).
        fake_classes: class count of kind fake.
        fake_files: kind fake is written under this folder in CIFAR-10's file format (32 px, 10 classes) and read
            back by the CIFAR-10 reader (a recipe that must exercise that reader); None: fake images stay in memory.
        limit: the most images to keep; None: the split's own limit (`data.train_limit` / `data.eval_limit`).

    Returns:
        The split, or None for the eval split of an image folder without val/ (logged as a warning).

    Raises:
        UsageError: a missing root, folder or file; train/ and val/ with other classes.
        ValueError: a transform that cannot read the kind (PadCropFlip of a folder or the digits): a programming
            error, since each recipe's data group admits only the kinds its transforms read.
    """
    if limit is None:
        limit = data.train_limit if split == "train" else data.eval_limit
    if data.kind == "image-folder":
        return _folder_split(data, split, transform, seed=seed, limit=limit)
    if data.kind == "cifar10" or (data.kind == "fake" and fake_files is not None):
        images = _cifar_format(data, split, fake_files)
    elif data.kind == "digits":
        images = _digits(split, _side(transform, "digits"))
    else:
        images = _fake(data, split, _side(transform, "fake"), fake_classes)
    return _memory_split(images.first(limit), transform, seed=seed, total=len(images.labels_N))


def num_classes(data: DataConfig, fake_classes: int = 10) -> int:
    """The class count of the data without reading an image: an image folder's class folders under train/, 10 for
    CIFAR-10 and the digits, `fake_classes` for fake images."""
    if data.kind == "image-folder":
        if not (data.root / "train").is_dir():
            raise UsageError(f"image folder {data.root / 'train'} not found; pass --data.root with train/ and val/")
        return len(list_classes(data.root / "train"))
    return fake_classes if data.kind == "fake" else 10


@dataclass
class EvalImages:
    """Normalised, un-augmented images of a kNN bank (training split) and its queries (held-out split)."""

    bank_N3HW: torch.Tensor
    bank_labels_N: torch.Tensor
    query_N3HW: torch.Tensor
    query_labels_N: torch.Tensor
    num_classes: int


def eval_images(data: DataConfig, image_size: int) -> EvalImages:
    """A kNN bank (the training split) and its queries (the held-out split), each at most `data.eval_limit` images,
    normalised for their kind (`normalisation`) without augmentation: folders centre-cropped at `image_size`.

    Raises:
        UsageError: as `open_split`, or an image folder without val/.
    """
    mean, std = normalisation(data.kind)
    plain = Normalise(image_size, mean, std)
    bank = open_split(data, "train", plain, limit=data.eval_limit)
    queries = open_split(data, "eval", plain)
    if bank is None or queries is None:
        raise UsageError(f"a kNN evaluation needs held-out images: {data.root / 'val'} not found")
    bank_N3HW, bank_labels_N = stacked(bank)
    query_N3HW, query_labels_N = stacked(queries)
    return EvalImages(bank_N3HW, bank_labels_N, query_N3HW, query_labels_N, bank.num_classes)


def stacked(split: ImageSplit, batch_size: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """All images and labels of a split as two tensors, (N, 3, H, W) and (N,) int64 (a kNN bank, queries)."""
    data = split.images
    if isinstance(data, NamedTensorDataset):
        return data.tensors["image"], data.tensors["label"].long()
    loader = DataLoader(data, batch_size=batch_size, shuffle=False)
    batches = list(loader)
    return torch.cat([b["image"] for b in batches]), torch.cat([b["label"] for b in batches]).long()


# ------------------------------------------------------------------------------------------------ folders
def has_held_out_folder(data: DataConfig) -> bool:
    """Whether an image folder has val/, checked against train/ from the class folders' names alone (no scan: a
    recipe can ask before its first epoch what its evaluation would find after it).

    Raises:
        UsageError: val/ and train/ have different class folders.
    """
    folder, train = data.root / "val", data.root / "train"
    if not folder.is_dir():
        return False
    if list_classes(folder) != list_classes(train):
        raise UsageError(f"{folder} and {train} have different class folders; both need the same classes")
    return True


def _folder_split(data: DataConfig, split: Split, transform: Transform, *, seed: int, limit: int) -> ImageSplit | None:
    root = data.root
    if not root.is_dir():
        others = ", ".join(k for k in accepted_kinds(type(data)) if k != "image-folder")
        raise UsageError(
            f"--data.root {root} not found: pass a folder holding train/<class>/* and val/<class>/* (ImageNet "
            f"layout){f', or another --data.kind ({others})' if others else ''}"
        )
    folder = root / ("train" if split == "train" else "val")
    if split == "eval" and not has_held_out_folder(data):
        log.warning("no held-out folder %s: evaluation is off", folder)
        return None
    index = scan_image_folder(folder)
    images: Dataset[Batch]
    if isinstance(transform, VarResizeCrop):
        train = transform.crop == "random"
        images = ImageFolderDataset(
            folder,
            image_size=transform.image_size,
            train=train,
            seed=seed,
            flip=transform.flip,
            index=index,
            limit=limit,
        )
    elif isinstance(transform, TwoViews):
        images = FolderTwoViews(folder, transform, seed=seed, index=index, limit=limit)
    elif isinstance(transform, (RandomResizedCropFlip, ResizeCenterCrop)):
        train = isinstance(transform, RandomResizedCropFlip)
        images = ResizedCropFolder(
            folder,
            image_size=transform.image_size,
            train=train,
            seed=seed,
            mean=transform.mean,
            std=transform.std,
            limit=limit,
            index=index,
        )
    elif isinstance(transform, Normalise):
        centred = ImageFolderDataset(folder, image_size=transform.image_size, train=False, index=index, limit=limit)
        images = MapImage(centred, functools.partial(_normalise_signed, mean=transform.mean, std=transform.std))
    else:
        raise ValueError(f"{type(transform).__name__} applies to CIFAR-format images, not to an image folder")
    size = len(images)
    description = {
        "kind": "image-folder",
        "size": size,
        "num_classes": len(index.classes),
        "listing_sha256": index.listing_sha256(),
        "image_size": getattr(transform, "image_size", None),
    }
    if size < len(index.files):
        description["limit"] = size
    return ImageSplit(images, len(index.classes), description, len(index.files))


def _normalise_signed(img_3HW: torch.Tensor, *, mean: Stats, std: Stats) -> torch.Tensor:
    """A [-1, 1] image (a folder's centre crop) normalised as [0, 1] pixels."""
    return normalise(img_3HW.add(1.0).div(2.0).unsqueeze(0), mean, std)[0]


# ---------------------------------------------------------------------------------------------- in memory
@dataclass
class _InMemory:
    """A split held in memory: uint8 (CIFAR-10) or float in [-1, 1] (digits, fake) images and int64 labels."""

    images_N3HW: torch.Tensor
    labels_N: torch.Tensor
    num_classes: int
    description: dict[str, Any]

    def first(self, limit: int) -> _InMemory:
        if limit <= 0 or limit >= len(self.labels_N):
            return self
        return _InMemory(
            self.images_N3HW[:limit], self.labels_N[:limit], self.num_classes, {**self.description, "limit": limit}
        )

    def unit(self) -> torch.Tensor:
        """The images as [0, 1] floats, or uint8 as they are (the consumers divide by 255)."""
        if self.images_N3HW.dtype == torch.uint8:
            return self.images_N3HW
        return self.images_N3HW.add(1.0).div(2.0)

    def signed(self) -> torch.Tensor:
        """The images as floats in [-1, 1] (the default dtype)."""
        if self.images_N3HW.dtype == torch.uint8:
            return self.images_N3HW.to(torch.get_default_dtype()).div(127.5).sub(1.0)
        return self.images_N3HW


def _side(transform: Transform, kind: str) -> int:
    side = getattr(transform, "image_size", None)
    if side is None:
        raise ValueError(f"{type(transform).__name__} has no image side to make {kind} images at")
    return int(side)


def _memory_split(data: _InMemory, transform: Transform, *, seed: int, total: int) -> ImageSplit:
    images: Dataset[Batch]
    if isinstance(transform, VarResizeCrop):
        images = TensorImageDataset(data.signed(), data.labels_N, flip=transform.flip, seed=seed)
    elif isinstance(transform, TwoViews):
        images = TensorTwoViews(data.unit(), data.labels_N, transform, seed=seed)
    elif isinstance(transform, RandomResizedCropFlip):
        images = ResizedCropTensors(
            data.unit(),
            data.labels_N,
            image_size=transform.image_size,
            seed=seed,
            mean=transform.mean,
            std=transform.std,
        )
    elif isinstance(transform, (ResizeCenterCrop, Normalise)):
        images = NamedTensorDataset(image=normalise(data.unit(), transform.mean, transform.std), label=data.labels_N)
    else:
        from trainlab.data.cifar import CifarAugmentDataset

        if data.images_N3HW.dtype != torch.uint8:
            raise ValueError("pad_crop_flip reads uint8 images (kinds cifar10 and fake), not the digits")
        images_NHW3 = data.images_N3HW.permute(0, 2, 3, 1).numpy()
        images = CifarAugmentDataset(
            images_NHW3, data.labels_N.numpy(), augment=True, seed=seed, mean=transform.mean, std=transform.std
        )
    return ImageSplit(images, data.num_classes, data.description, total)


def _cifar_format(data: DataConfig, split: Split, fake_files: Path | None) -> _InMemory:
    """CIFAR-10 (or fake images written in its file format) through the CIFAR-10 reader, as uint8 (N, 3, 32, 32)."""
    from trainlab.data.cifar import load_cifar10

    root = data.root
    if data.kind == "fake":
        from trainlab.data.fake_cifar import write_fake_cifar10

        assert fake_files is not None
        num_train, num_eval = data.fake_size, fake_eval_size(data.fake_size)
        root = fake_files / f"train{num_train}-test{num_eval}"  # a set of another size is another folder
        if not (root / "cifar-10-batches-py").is_dir():
            write_fake_cifar10(root, num_train=num_train, num_test=num_eval, seed=FAKE_SEED)
    raw = load_cifar10(root, train=split == "train", download=data.download and data.kind == "cifar10")
    images_N3HW = torch.from_numpy(raw.data).permute(0, 3, 1, 2).contiguous()
    description = {"kind": data.kind, "split": split, "size": len(raw), "image_size": 32}
    return _InMemory(images_N3HW, torch.tensor(raw.targets, dtype=torch.long), 10, description)


def _digits(split: Split, image_size: int) -> _InMemory:
    from trainlab.data.digits import NUM_CLASSES, load_digits_dataset

    part: Literal["train", "heldout"] = "train" if split == "train" else "heldout"
    digits = load_digits_dataset(resolution=image_size, split=part, seed=DIGITS_SPLIT_SEED)
    description = {"kind": "digits", "split": part, "size": len(digits), "image_size": image_size}
    return _InMemory(digits.images_N3HW, digits.labels_N, NUM_CLASSES, description)


def _fake(data: DataConfig, split: Split, image_size: int, num_classes: int) -> _InMemory:
    from trainlab.data.synthetic import synthetic_splits

    num_eval = fake_eval_size(data.fake_size)
    splits = synthetic_splits(data.fake_size, num_eval, image_size=image_size, num_classes=num_classes, seed=FAKE_SEED)
    images = splits[0] if split == "train" else splits[1]
    size = len(images.labels_N)
    description = {"kind": "fake", "split": split, "size": size, "image_size": image_size, "classes": num_classes}
    return _InMemory(torch.from_numpy(images.images_N3SS), torch.from_numpy(images.labels_N), num_classes, description)
