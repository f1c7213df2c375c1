"""Image splits for a generator's training: training and validation images, their class count, a description of
their content (the token cache's fingerprint) and how to build fixed-preprocessing variants (plain / mirrored) for
a cache. Datasets: an ImageNet-layout folder, the bundled digits, or synthetic class-coloured gradients.
`reconstruction_splits` gives a tokenizer's training images and held-out images (labels unused).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch.utils.data import Dataset, Subset

from trainlab.data.image_folder import FolderIndex, ImageFolderDataset, scan_image_folder
from trainlab.data.synthetic import class_gradient_images, smooth_noise_images
from trainlab.data.tensors import FlipMode, NamedTensorDataset, TensorImageDataset
from trainlab.data.token_cache import VARIANT_MIRRORED
from trainlab.errors import UsageError

log = logging.getLogger(__name__)

SplitKind = Literal["image-folder", "digits", "fake"]
Variants = Callable[[tuple[str, ...]], list[Dataset[dict[str, torch.Tensor]]]]


@dataclass
class ImageSplit:
    """One split's image dataset, class count, content description, and its cache variants."""

    images: Dataset[dict[str, torch.Tensor]]
    num_classes: int
    description: dict[str, Any]
    variants: Variants


def image_splits(
    kind: SplitKind,
    *,
    data_root: Path,
    image_size: int,
    horizontal_flip: bool,
    seed: int,
    fake_num_images: int,
    fake_classes: int,
) -> tuple[ImageSplit, ImageSplit | None]:
    """(training split, validation split or None when an image folder has no val/).

    Training images are flipped at random when `horizontal_flip` (draws from (seed, epoch, index)); validation
    images never. Digits use the fixed train / held-out split; fake images draw the validation set from seed + 1.
    """
    if kind == "image-folder":
        train_index = scan_image_folder(data_root / "train")

        train_set = ImageFolderDataset(
            train_index.root,
            image_size=image_size,
            train=True,
            horizontal_flip=horizontal_flip,
            seed=seed,
            index=train_index,
        )
        train = ImageSplit(
            train_set, len(train_index.classes), train_set.describe(), _folder_variants(train_index, image_size)
        )
        val_root = data_root / "val"
        if not val_root.is_dir():
            log.warning("no validation folder %s: evaluation is off", val_root)
            return train, None
        val_index = scan_image_folder(val_root)
        if val_index.classes != train_index.classes:
            raise UsageError(
                f"{val_root} and {data_root / 'train'} have different class folders; both need the same classes"
            )
        val_set = ImageFolderDataset(val_root, image_size=image_size, train=False, index=val_index)
        return train, ImageSplit(
            val_set, len(val_index.classes), val_set.describe(), _folder_variants(val_index, image_size)
        )

    if kind == "digits":
        from trainlab.data.digits import NUM_CLASSES, load_digits_dataset

        def digits(split: Literal["train", "heldout"]) -> ImageSplit:
            data = load_digits_dataset(resolution=image_size, split=split, seed=0)  # fixed split, as the judge
            desc = {"kind": "digits", "split": split, "size": len(data), "image_size": image_size}
            train = split == "train"
            return _tensor_split(
                data.images_N3HW, data.labels_N, NUM_CLASSES, desc, train=train, flip_train=horizontal_flip, seed=seed
            )

        return digits("train"), digits("heldout")

    def fake(num: int, data_seed: int, train: bool) -> ImageSplit:
        images_N3HW, labels_N = class_gradient_images(num, image_size, fake_classes, data_seed)
        desc = {"kind": "fake", "size": num, "seed": data_seed, "image_size": image_size, "classes": fake_classes}
        return _tensor_split(
            images_N3HW, labels_N, fake_classes, desc, train=train, flip_train=horizontal_flip, seed=seed
        )

    return fake(fake_num_images, seed, True), fake(max(fake_num_images // 4, 8), seed + 1, False)


def _folder_variants(index: FolderIndex, image_size: int) -> Variants:
    def make(variants: tuple[str, ...]) -> list[Dataset[dict[str, torch.Tensor]]]:
        return [
            ImageFolderDataset(
                index.root,
                image_size=image_size,
                train=False,
                flip="always" if v == VARIANT_MIRRORED else "none",
                index=index,
            )
            for v in variants
        ]

    return make


def _tensor_split(
    images_N3HW: torch.Tensor,
    labels_N: torch.Tensor,
    num_classes: int,
    desc: dict[str, Any],
    *,
    train: bool,
    flip_train: bool,
    seed: int,
) -> ImageSplit:
    """A split of in-memory images (digits, fake): random flips when training with flips; variants plain / mirrored."""

    def make(variants: tuple[str, ...]) -> list[Dataset[dict[str, torch.Tensor]]]:
        flips: list[FlipMode] = ["always" if v == VARIANT_MIRRORED else "none" for v in variants]
        return [TensorImageDataset(images_N3HW, labels_N, flip=f) for f in flips]

    flip: FlipMode = "random" if train and flip_train else "none"
    return ImageSplit(TensorImageDataset(images_N3HW, labels_N, flip=flip, seed=seed), num_classes, desc, make)


DIGITS_SPLIT_SEED = 0  # the digits' train / held-out split is fixed, so held-out metrics compare across seeds


def reconstruction_splits(
    kind: SplitKind,
    *,
    data_root: Path,
    image_size: int,
    random_crop: bool,
    fake_size: int,
    heldout_size: int,
    seed: int,
) -> tuple[Dataset[Any], Dataset[Any]]:
    """(training images, at most `heldout_size` held-out images) for a tokenizer / autoencoder.

    digits: the bundled train / held-out split; fake: smooth noise images (label 0); image-folder: train/ with a
    center or random crop, and evenly spaced images of val/ (sorted by class, so all classes are covered).
    """
    if kind == "digits":
        from trainlab.data.digits import load_digits_dataset

        digits_train = load_digits_dataset(resolution=image_size, split="train", seed=DIGITS_SPLIT_SEED)
        digits_heldout = load_digits_dataset(resolution=image_size, split="heldout", seed=DIGITS_SPLIT_SEED)
        return digits_train, Subset(digits_heldout, range(min(heldout_size, len(digits_heldout))))
    if kind == "fake":
        return noise_images(fake_size, image_size, seed=1), noise_images(heldout_size, image_size, seed=2)
    if not data_root.is_dir():
        raise UsageError(
            f"--data-root {data_root} not found: pass a folder holding train/<class>/* and val/<class>/* "
            "(ImageNet layout), or use --dataset digits"
        )
    if not (data_root / "val").is_dir():
        raise UsageError(f"{data_root}/val not found: the held-out evaluation needs val/<class>/* next to train/")
    train = ImageFolderDataset(data_root / "train", image_size=image_size, train=random_crop, seed=seed)
    heldout = ImageFolderDataset(data_root / "val", image_size=image_size, train=False)
    return train, _even_subset(heldout, heldout_size)


def noise_images(num_images: int, image_size: int, seed: int) -> NamedTensorDataset:
    """Smooth random RGB images in [-1, 1] with label 0, as {"image", "label"} samples (tests, --debug)."""
    images_N3HW = smooth_noise_images(num_images, image_size, seed)
    return NamedTensorDataset(image=images_N3HW, label=torch.zeros(num_images, dtype=torch.long))


def _even_subset(data: Dataset[Any], size: int) -> Dataset[Any]:
    """`size` evenly spaced items (an image folder is sorted by class, so this covers the classes)."""
    n = len(data)  # type: ignore[arg-type]
    if size >= n:
        return data
    return Subset(data, torch.linspace(0, n - 1, size).round().long().tolist())
