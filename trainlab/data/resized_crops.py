"""Datasets of RandomResizedCrop views (`random_resized_crop_flip`, for training) or Resize + CenterCrop views
(`resize_center_crop`, for evaluation): the official linear-probe transforms of facebookresearch/moco-v3
main_lincls.py at any image side S, or any recipe's that wants them (`trainlab.data.transforms`).

Randomness: the training view of sample i in epoch e is a pure function of (seed, e, i), so resume and loader
workers do not change the pixels.

Shape legend: C channels (3), H/W pixels, S output side, N images.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torchvision.transforms.v2.functional as TF
from torch.utils.data import Dataset

from trainlab.data.augment import EpochCounter
from trainlab.data.image_folder import FolderIndex, ImageFolderDataset
from trainlab.data.transforms import random_resized_crop_flip, resize_center_crop


class ResizedCropTensors(Dataset[dict[str, torch.Tensor]]):
    """In-memory images as `{"image": (3, S, S), "label": int64}` with `random_resized_crop_flip`.

    Args:
        images_N3HW: uint8 or float32 in [0, 1].
        labels_N: int labels.
    """

    def __init__(
        self,
        images_N3HW: torch.Tensor,
        labels_N: torch.Tensor,
        *,
        image_size: int,
        seed: int,
        mean: Sequence[float],
        std: Sequence[float],
    ) -> None:
        self.images_N3HW = images_N3HW
        self.labels_N = labels_N.long()
        self.image_size = image_size
        self.seed = seed
        self.mean, self.std = tuple(mean), tuple(std)
        self._epoch = EpochCounter()

    def set_epoch(self, epoch: int) -> None:
        self._epoch.set(epoch)

    def __len__(self) -> int:
        return int(self.labels_N.shape[0])

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        image = random_resized_crop_flip(
            self.images_N3HW[index],
            self.image_size,
            seed=self.seed,
            epoch=self._epoch.get(),
            index=index,
            mean=self.mean,
            std=self.std,
        )
        return {"image": image, "label": self.labels_N[index].clone()}


class ResizedCropFolder(ImageFolderDataset):
    """An ImageNet-layout split (`root/<class>/*`) as `{"image": (3, S, S), "label": int64}`:
    `random_resized_crop_flip` when `train`, else `resize_center_crop`.

    Scanning, decoding, the skipping of unreadable files and `limit` are `ImageFolderDataset`'s.
    """

    def __init__(
        self,
        root: str | Path,
        *,
        image_size: int,
        train: bool,
        seed: int = 0,
        mean: Sequence[float],
        std: Sequence[float],
        limit: int = 0,
        index: FolderIndex | None = None,
    ) -> None:
        super().__init__(root, image_size=image_size, train=train, seed=seed, index=index, limit=limit)
        self.train = train
        self.mean, self.std = tuple(mean), tuple(std)

    def _read(self, position: int) -> tuple[int, Any]:
        if self.train:  # uint8 pixels, cropped and resized before any float conversion
            return self._reader.read_pixels(position)
        return self._reader.read(position)

    def _transform(self, img: Any, index: int) -> torch.Tensor:
        if self.train:
            return random_resized_crop_flip(
                img, self.image_size, seed=self.seed, epoch=self.epoch, index=index, mean=self.mean, std=self.std
            )
        return resize_center_crop(TF.pil_to_tensor(img), self.image_size, mean=self.mean, std=self.std)

    def describe(self) -> dict[str, Any]:
        """What identifies this dataset's content and transform."""
        content = {k: v for k, v in super().describe().items() if k not in ("crop", "flip", "jpeg_decode", "resize")}
        return {**content, "transform": "random_resized_crop_flip" if self.train else "resize_center_crop"}
