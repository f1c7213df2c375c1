"""MoCo v3's two asymmetric views (BYOL's recipe), drawn as a pure function of (seed, epoch, index).

Both views: RandomResizedCrop(S, scale=(crop_min, 1), ratio=(3/4, 4/3)), ColorJitter(0.4, 0.4, 0.2, 0.1) with
p 0.8 (the four adjustments in a random order, as torchvision does), RandomGrayscale p 0.2, horizontal flip p 0.5.
View 1: Gaussian blur (sigma in [0.1, 2]) with p 1.0; view 2: blur p 0.1 and solarize (threshold 128/255) p 0.2.
`blur=False` is the CIFAR-size variant (no blur on either view). Order as in main_moco.py: crop, jitter, grey, blur,
solarize, flip, then normalise.

Randomness: one 64-bit word `draw_words(seed, epoch, index, num_words=1)` seeds a `random.Random` (whose sequence
Python guarantees across versions) that draws view 1 then view 2; no global RNG enters, so resumed runs and any
number of loader workers see the same views. The blur runs on tensors with kernel 2*ceil(3*sigma)+1 (capped to the
image), where the official code calls PIL's `GaussianBlur(radius=sigma)`: the same Gaussian, a different truncation.

Shape legend: C channels (3), H/W pixels, S output side, N images.
"""

from __future__ import annotations

import logging
import math
import random
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torchvision.transforms.v2.functional as TF
from torch.utils.data import Dataset

from trainlab.data.augment import EpochCounter, draw_words
from trainlab.data.image_folder import FolderIndex, UnreadableSkipper, scan_image_folder

log = logging.getLogger(__name__)

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
HALF = (0.5, 0.5, 0.5)  # maps [0, 1] to [-1, 1] (digits)


@dataclass(frozen=True)
class ViewSpec:
    """The augmentation of both views.

    Attributes:
        image_size: S, the output side.
        crop_min: smallest crop area fraction (official `--crop-min`: 0.08 ViT, 0.2 ResNet).
        blur: Gaussian blur p 1.0 / 0.1 on views 1 / 2 (False: the CIFAR-size variant, no blur).
        mean: per-channel mean subtracted from [0, 1] pixels.
        std: per-channel std divided by.
    """

    image_size: int
    crop_min: float = 0.08
    blur: bool = True
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD


def random_resized_crop_box(rng: random.Random, height: int, width: int, crop_min: float) -> tuple[int, int, int, int]:
    """torchvision's RandomResizedCrop.get_params with `rng`: (top, left, h, w)."""
    area = height * width
    log_ratio = (math.log(3 / 4), math.log(4 / 3))
    for _ in range(10):
        target_area = area * rng.uniform(crop_min, 1.0)
        aspect = math.exp(rng.uniform(*log_ratio))
        w = round(math.sqrt(target_area * aspect))
        h = round(math.sqrt(target_area / aspect))
        if 0 < w <= width and 0 < h <= height:
            return rng.randint(0, height - h), rng.randint(0, width - w), h, w
    in_ratio = width / height  # fallback: central crop
    if in_ratio < 3 / 4:
        w, h = width, round(width / (3 / 4))
    elif in_ratio > 4 / 3:
        h, w = height, round(height * (4 / 3))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def one_view(
    img_CHW: torch.Tensor, rng: random.Random, spec: ViewSpec, *, p_blur: float, p_solarize: float
) -> torch.Tensor:
    """One augmented view of a float image in [0, 1] (C, H, W), normalised; consumes `rng` in a fixed order."""
    top, left, h, w = random_resized_crop_box(rng, img_CHW.shape[-2], img_CHW.shape[-1], spec.crop_min)
    x_CSS = TF.resized_crop(img_CHW, top, left, h, w, [spec.image_size, spec.image_size], antialias=True)
    x_CSS = x_CSS.clamp(0.0, 1.0)
    if rng.random() < 0.8:  # colour jitter, the four adjustments in a random order
        order = rng.sample(range(4), 4)
        brightness, contrast = rng.uniform(0.6, 1.4), rng.uniform(0.6, 1.4)
        saturation, hue = rng.uniform(0.8, 1.2), rng.uniform(-0.1, 0.1)
        for op in order:
            if op == 0:
                x_CSS = TF.adjust_brightness(x_CSS, brightness)
            elif op == 1:
                x_CSS = TF.adjust_contrast(x_CSS, contrast)
            elif op == 2:
                x_CSS = TF.adjust_saturation(x_CSS, saturation)
            else:
                x_CSS = TF.adjust_hue(x_CSS, hue)
    if rng.random() < 0.2:
        x_CSS = TF.rgb_to_grayscale(x_CSS, num_output_channels=3)
    if rng.random() < p_blur:
        sigma = rng.uniform(0.1, 2.0)
        kernel = min(2 * math.ceil(3 * sigma) + 1, spec.image_size - (1 - spec.image_size % 2))
        x_CSS = TF.gaussian_blur(x_CSS, [kernel, kernel], [sigma, sigma])
    if rng.random() < p_solarize:
        x_CSS = TF.solarize(x_CSS, threshold=128 / 255)
    if rng.random() < 0.5:
        x_CSS = TF.horizontal_flip(x_CSS)
    return TF.normalize(x_CSS, list(spec.mean), list(spec.std))


def two_views(
    img_CHW: torch.Tensor, spec: ViewSpec, *, seed: int, epoch: int, index: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Views 1 and 2 of sample `index` in `epoch`: a pure function of (image, spec, seed, epoch, index)."""
    (word,) = draw_words(seed, epoch, index, num_words=1)
    rng = random.Random(word)
    view1 = one_view(img_CHW, rng, spec, p_blur=1.0 if spec.blur else 0.0, p_solarize=0.0)
    view2 = one_view(img_CHW, rng, spec, p_blur=0.1 if spec.blur else 0.0, p_solarize=0.2)
    return view1, view2


class TwoViewDataset(Dataset[dict[str, torch.Tensor]], ABC):
    """Images as `{"view1": (3, S, S), "view2": (3, S, S), "label": int64}` (the label only for monitoring).

    Subclasses provide `_sample(index)`: the image, (3, H, W) in [0, 1] in the default dtype (float32), and its
    class id. Call `set_epoch` before each epoch.
    """

    def __init__(self, spec: ViewSpec, *, seed: int) -> None:
        self.spec = spec
        self.seed = seed
        self._epoch = EpochCounter()

    def set_epoch(self, epoch: int) -> None:
        self._epoch.set(epoch)

    @abstractmethod
    def _sample(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample `index`: (3, H, W) in [0, 1] in the default dtype, and its class id (int64 scalar, for monitoring
        only)."""

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        img_CHW, label = self._sample(index)
        view1, view2 = two_views(img_CHW, self.spec, seed=self.seed, epoch=self._epoch.get(), index=index)
        return {"view1": view1, "view2": view2, "label": label}


class TensorTwoViews(TwoViewDataset):
    """Two views of in-memory images (digits, CIFAR-10).

    Args:
        images_N3HW: float32 in [0, 1] or uint8.
        labels_N: int64 labels.
    """

    def __init__(self, images_N3HW: torch.Tensor, labels_N: torch.Tensor, spec: ViewSpec, *, seed: int) -> None:
        super().__init__(spec, seed=seed)
        self.images_N3HW = images_N3HW
        self.labels_N = labels_N.long()

    def __len__(self) -> int:
        return int(self.labels_N.shape[0])

    def _sample(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        img = self.images_N3HW[index]
        dtype = torch.get_default_dtype()
        img = img.to(dtype).div(255.0) if img.dtype == torch.uint8 else img.to(dtype)
        return img, self.labels_N[index].clone()


class FolderTwoViews(TwoViewDataset):
    """Two views of an ImageNet-layout folder (official main_moco.py: `ImageFolder(traindir, TwoCropsTransform)`).

    Scanning, reading and the skipping of unreadable images are the image folder's (`trainlab.data.image_folder`):
    an unreadable image is replaced by the next readable one, counted (`skipped_images`) and warned about; the views
    are still drawn from (seed, epoch, index) of the requested sample.
    """

    def __init__(self, root: str | Path, spec: ViewSpec, *, seed: int, index: FolderIndex | None = None) -> None:
        super().__init__(spec, seed=seed)
        self.index = index if index is not None else scan_image_folder(root)
        self._reader = UnreadableSkipper(self.index)

    def __len__(self) -> int:
        return len(self.index.files)

    @property
    def skipped_images(self) -> int:
        """Unreadable images replaced since the last `set_epoch` (all loader workers together)."""
        return self._reader.skipped

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch of the view draws; logs and resets the previous epoch's skip count."""
        skipped = self._reader.reset()
        if skipped:
            log.warning(
                "%s: epoch %d replaced %d unreadable image(s) by the next readable one",
                self.index.root,
                self._epoch.get(),
                skipped,
            )
        super().set_epoch(epoch)

    def _sample(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        position, img = self._reader.read(index)
        img_CHW = TF.to_dtype(TF.pil_to_tensor(img), torch.get_default_dtype(), scale=True)
        return img_CHW, torch.tensor(self.index.files[position][1], dtype=torch.long)


def normalise(images_N3HW: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """[0, 1] (or uint8) images normalised with `mean` / `std` (evaluation inputs, no augmentation)."""
    dtype = torch.get_default_dtype()
    x = images_N3HW.to(dtype).div(255.0) if images_N3HW.dtype == torch.uint8 else images_N3HW.to(dtype)
    mean_311 = torch.tensor(mean, dtype=dtype).view(1, 3, 1, 1)
    std_311 = torch.tensor(std, dtype=dtype).view(1, 3, 1, 1)
    return (x - mean_311) / std_311
