"""Linear-probe inputs, the official transforms of facebookresearch/moco-v3 main_lincls.py at any image side S.

Train: RandomResizedCrop(S, scale=(0.08, 1), ratio=(3/4, 4/3)) + RandomHorizontalFlip, ToTensor, Normalize.
Eval:  Resize(round(S * 256 / 224)) on the shorter side (256 at S = 224) + CenterCrop(S), ToTensor, Normalize.
Resizing is bilinear with antialias on tensors, where the official code resizes PIL images (bilinear).

Randomness: the train view of sample i in epoch e is a pure function of (seed, e, i): `augment_draws` gives two
words; word 0 seeds a `random.Random` that places the crop (`ssl_views.random_resized_crop_box`, torchvision's
get_params) and the low bit of word 1 is the flip (`decide_flip`). No global RNG, so resume and loader workers
do not change the pixels.

Shape legend: C channels (3), H/W pixels, S output side, N images.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torchvision.transforms.v2.functional as TF
from PIL import Image
from torch.utils.data import Dataset

from trainlab.data.augment import EpochCounter, augment_draws, decide_flip
from trainlab.data.image_folder import FolderIndex, ImageFolderDataset
from trainlab.data.ssl_views import random_resized_crop_box

CROP_MIN = 0.08  # RandomResizedCrop's default scale (0.08, 1), as main_lincls.py uses it
EVAL_RESIZE_RATIO = 256 / 224  # Resize(256) + CenterCrop(224)


def _to_float(img_CHW: torch.Tensor) -> torch.Tensor:
    dtype = torch.get_default_dtype()
    return img_CHW.to(dtype).div(255.0) if img_CHW.dtype == torch.uint8 else img_CHW.to(dtype)


def probe_train_view(
    img_CHW: torch.Tensor,
    image_size: int,
    *,
    seed: int,
    epoch: int,
    index: int,
    mean: Sequence[float],
    std: Sequence[float],
) -> torch.Tensor:
    """RandomResizedCrop(S) + flip of one image (uint8 or float in [0, 1]), normalised: (3, S, S) float32.

    A pure function of (image, image_size, seed, epoch, index, mean, std).
    """
    draws = augment_draws(seed, epoch, index)
    x_CHW = _to_float(img_CHW)
    top, left, h, w = random_resized_crop_box(random.Random(draws[0]), x_CHW.shape[-2], x_CHW.shape[-1], CROP_MIN)
    x_CSS = TF.resized_crop(x_CHW, top, left, h, w, [image_size, image_size], antialias=True).clamp(0.0, 1.0)
    if decide_flip("random", draws):
        x_CSS = TF.horizontal_flip(x_CSS)
    return TF.normalize(x_CSS, list(mean), list(std))


def probe_eval_view(
    img_CHW: torch.Tensor, image_size: int, *, mean: Sequence[float], std: Sequence[float]
) -> torch.Tensor:
    """Resize(round(S * 256 / 224)) of the shorter side + CenterCrop(S), normalised: (3, S, S) float32."""
    x_CHW = TF.resize(_to_float(img_CHW), [round(image_size * EVAL_RESIZE_RATIO)], antialias=True)
    x_CSS = TF.center_crop(x_CHW, [image_size, image_size]).clamp(0.0, 1.0)
    return TF.normalize(x_CSS, list(mean), list(std))


class ProbeTensorViews(Dataset[dict[str, torch.Tensor]]):
    """In-memory images (CIFAR-10) as `{"image": (3, S, S), "label": int64}` with the train augmentation.

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
        image = probe_train_view(
            self.images_N3HW[index],
            self.image_size,
            seed=self.seed,
            epoch=self._epoch.get(),
            index=index,
            mean=self.mean,
            std=self.std,
        )
        return {"image": image, "label": self.labels_N[index].clone()}


class ProbeFolder(ImageFolderDataset):
    """An ImageNet-layout split (`root/<class>/*`) as `{"image": (3, S, S), "label": int64}` with the official
    linear-probe transform: `probe_train_view` when `train`, else `probe_eval_view`.

    Scanning, decoding and the skipping of unreadable files are `ImageFolderDataset`'s. `subset` > 0 keeps `subset`
    images evenly spaced over the class-sorted listing (every class represented), for debugging.
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
        subset: int = 0,
        index: FolderIndex | None = None,
    ) -> None:
        super().__init__(root, image_size=image_size, train=train, seed=seed, index=index)
        self.train = train
        self.mean, self.std = tuple(mean), tuple(std)
        n = len(self.index.files)
        keep = n if subset <= 0 else min(subset, n)
        step = max(n // keep, 1)
        self.positions = tuple(range(0, step * keep, step))

    def __len__(self) -> int:
        return len(self.positions)

    def _transform(self, img: Image.Image, index: int) -> torch.Tensor:
        x_CHW = TF.pil_to_tensor(img)
        if self.train:
            return probe_train_view(
                x_CHW, self.image_size, seed=self.seed, epoch=self.epoch, index=index, mean=self.mean, std=self.std
            )
        return probe_eval_view(x_CHW, self.image_size, mean=self.mean, std=self.std)

    def _position(self, index: int) -> int:
        return self.positions[index]

    def describe(self) -> dict[str, Any]:
        """What identifies this dataset's content and transform."""
        content = {k: v for k, v in super().describe().items() if k not in ("crop", "flip")}
        return {**content, "transform": "linear-probe train" if self.train else "linear-probe eval"}
