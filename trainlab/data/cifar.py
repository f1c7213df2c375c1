"""CIFAR-10: loading the python-pickle release and the standard train-time augmentation.

Two pieces:
- `load_cifar10` returns torchvision's `CIFAR10` (via the thin subclass `TrainlabCIFAR10`, see its docstring for
  why) and turns every way the data can be missing or broken into a one-line `UsageError`.
- `CifarAugmentDataset` applies the kuangliu/airbench recipe (random 32x32 crop of the 4-pixel zero-padded image,
  horizontal flip with p=0.5, per-channel normalisation). Its randomness is a pure function of
  (seed, epoch, sample index), so a run resumed at any step, with any number of loader workers, sees exactly the
  same augmented pixels as an uninterrupted run.

Normalisation constants: mean (0.4914, 0.4822, 0.4465) and std (0.2470, 0.2435, 0.2616) are the per-channel mean
and standard deviation over all 50,000 training images (the values airbench uses). kuangliu/pytorch-cifar uses std
(0.2023, 0.1994, 0.2010), the average of per-image standard deviations, which is smaller and leaves the inputs with
a standard deviation of about 1.22 rather than 1. Both train fine behind BatchNorm; we pick the one that actually
standardises the data.
"""

# Shape legend: N dataset size, H/W height/width (32), 3 RGB channels.

from __future__ import annotations

import logging
import pickle
from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch
from torch.utils.data import Dataset
from torchvision.datasets import CIFAR10
from torchvision.datasets.utils import calculate_md5

from trainlab.data.augment import EpochCounter, draw_words, mixed_radix_digits
from trainlab.errors import UsageError

log = logging.getLogger(__name__)

CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
CIFAR10_DIRNAME = CIFAR10.base_folder  # "cifar-10-batches-py"
CIFAR10_NUM_CLASSES = 10
CROP_PADDING = 4


class TrainlabCIFAR10(CIFAR10):
    """torchvision's `CIFAR10` with the per-load md5 check replaced by a file-existence check.

    `CIFAR10.__init__` (torchvision 0.29) md5-hashes all six data files against hard-coded hashes on every
    construction (`_check_integrity`) and the metadata file in `_load_meta`. That rejects the small synthetic
    dataset written by `trainlab.data.fake_cifar` (same layout, different bytes), and re-hashes 178 MB each time a
    split is opened. Setting the per-file md5s to `None` makes torchvision's own `check_integrity` test existence
    only; everything else, the unpickling and array layout included, is torchvision's unchanged code. We use this
    class for ALL loading, so tests on fake data exercise the same code path as real runs.

    What still guards integrity: `download=True` verifies the archive's md5 (`tgz_md5` is kept); truncated or
    garbled files fail to unpickle or have the wrong shape, which `load_cifar10` reports; and
    `load_cifar10(..., verify_checksums=True)` compares the files against torchvision's official hashes.
    """

    train_list: ClassVar[list[list[str | None]]] = [[name, None] for name, _md5 in CIFAR10.train_list]
    test_list: ClassVar[list[list[str | None]]] = [[name, None] for name, _md5 in CIFAR10.test_list]
    meta: ClassVar[dict[str, str | None]] = {**CIFAR10.meta, "md5": None}


def _expected_files() -> list[str]:
    return [name for name, _md5 in CIFAR10.train_list + CIFAR10.test_list] + [str(CIFAR10.meta["filename"])]


def load_cifar10(root: str | Path, *, train: bool, download: bool = False, verify_checksums: bool = False) -> CIFAR10:
    """Opens one split of CIFAR-10 stored as `<root>/cifar-10-batches-py`.

    Args:
        root: directory that contains (or, with `download`, will contain) `cifar-10-batches-py/`.
        train: the 50,000-image training split if True, else the 10,000-image test split.
        download: fetch and extract the official archive (md5-checked) if the files are not there yet.
        verify_checksums: also compare every file with torchvision's official md5 (slow-ish; fails on fake data).

    Returns:
        A torchvision `CIFAR10` whose `.data` is uint8 (N, 32, 32, 3) and `.targets` a list of ints in [0, 10).

    Raises:
        UsageError: data missing (and `download` is False), incomplete, unreadable, corrupt, or the download failed.
    """
    root = Path(root).expanduser()
    folder = root / CIFAR10_DIRNAME
    if download:
        try:
            TrainlabCIFAR10(root, train=train, download=True)
        except (OSError, RuntimeError) as e:  # URLError is an OSError; a bad archive md5 is a RuntimeError
            raise UsageError(
                f"could not download CIFAR-10 into {root} ({_one_line(e)}); check the network, "
                f"or fetch {CIFAR10.url} yourself, extract it there and drop --download"
            ) from e
    if not folder.is_dir():
        raise UsageError(
            f"CIFAR-10 not found under {root} (expected {folder}); pass --download to fetch it, "
            "or --data-root to point at it"
        )
    missing = [name for name in _expected_files() if not (folder / name).is_file()]
    if missing:
        raise UsageError(
            f"CIFAR-10 under {root} is incomplete (missing {', '.join(missing)} in {folder}); "
            "delete that folder and pass --download to fetch it again"
        )
    if verify_checksums:
        for name, md5 in [*CIFAR10.train_list, *CIFAR10.test_list, [CIFAR10.meta["filename"], CIFAR10.meta["md5"]]]:
            if calculate_md5(folder / name) != md5:
                raise UsageError(
                    f"CIFAR-10 file {folder / name} does not match the official md5; "
                    "delete that folder and pass --download to fetch it again"
                )
    try:
        dataset = TrainlabCIFAR10(root, train=train, download=False)
    except (
        OSError,
        pickle.UnpicklingError,
        EOFError,
        KeyError,
        ValueError,
        TypeError,
        AttributeError,
        RuntimeError,
    ) as e:
        raise _corrupt(folder, _one_line(e)) from e
    _check_arrays(dataset, folder)
    log.info("loaded CIFAR-10 %s split: %d images from %s", "train" if train else "test", len(dataset), folder)
    return dataset


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _corrupt(folder: Path, detail: str) -> UsageError:
    return UsageError(
        f"CIFAR-10 under {folder} is corrupt or unreadable ({detail}); "
        "delete that folder and pass --download to fetch it again"
    )


def _check_arrays(dataset: CIFAR10, folder: Path) -> None:
    data = dataset.data
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 4 or data.shape[1:] != (32, 32, 3):
        raise _corrupt(
            folder,
            f"images are {getattr(data, 'dtype', type(data))} {getattr(data, 'shape', '')}, "
            "expected uint8 (N, 32, 32, 3)",
        )
    if len(dataset.targets) != len(data):
        raise _corrupt(folder, f"{len(data)} images but {len(dataset.targets)} labels")
    labels = np.asarray(dataset.targets)
    if len(labels) and (labels.min() < 0 or labels.max() >= CIFAR10_NUM_CLASSES):
        raise _corrupt(folder, f"labels outside [0, {CIFAR10_NUM_CLASSES})")


def augment_params(seed: int, epoch: int, index: int, *, padding: int = CROP_PADDING) -> tuple[int, int, bool]:
    """Draws the random crop offsets and flip for one sample, as a pure function of its arguments.

    One 64-bit word of `trainlab.data.augment.draw_words` is split into the mixed-radix digits `top`, `left`
    (uniform in [0, 2 * padding]) and `flip`. The result depends on nothing else (no global RNG, no worker id, no
    torch/numpy version), which is what makes resumed runs bit-exact. The modulo bias is below 1e-17.

    Args:
        seed: the run's data seed.
        epoch: 0-based epoch.
        index: index of the sample in the dataset.
        padding: zero padding on each side before the crop.

    Returns:
        (top, left, flip): crop offsets into the padded image and whether to mirror horizontally.
    """
    (word,) = draw_words(seed, epoch, index, num_words=1)
    span = 2 * padding + 1
    top, left, flip = mixed_radix_digits(word, span, span, 2)
    return top, left, flip == 1


def pad_crop_flip(
    img_3HW: torch.Tensor, top: int, left: int, flip: bool, *, padding: int = CROP_PADDING
) -> torch.Tensor:
    """Zero-pads by `padding`, crops back to the input size at (top, left), optionally mirrors left-right.

    Equivalent to torchvision's `RandomCrop(size, padding=padding)` + `RandomHorizontalFlip` with the given draws.
    """
    _, h, w = img_3HW.shape
    padded_3HW = img_3HW.new_zeros(img_3HW.shape[0], h + 2 * padding, w + 2 * padding)
    padded_3HW[:, padding : padding + h, padding : padding + w] = img_3HW
    out_3HW = padded_3HW[:, top : top + h, left : left + w]
    return out_3HW.flip(-1) if flip else out_3HW.contiguous()


class CifarAugmentDataset(Dataset[dict[str, torch.Tensor]]):
    """CIFAR images as normalised float tensors, with deterministic per-(seed, epoch, index) augmentation.

    Call `set_epoch(epoch)` before iterating the loader for that epoch (before `iter(loader)`). The epoch is an
    `EpochCounter` (shared memory), so the update reaches worker processes even with `persistent_workers=True`.

    Args:
        images_NHW3: uint8 images, (N, H, W, 3), e.g. `CIFAR10.data`.
        labels_N: integer class labels, length N.
        augment: apply random crop + flip (training); False gives normalisation only (evaluation).
        seed: data seed; with `augment`, the augmentation of sample i in epoch e depends only on (seed, e, i).
        mean: per-channel mean subtracted after scaling pixels to [0, 1].
        std: per-channel standard deviation divided by after subtracting the mean.
    """

    def __init__(
        self,
        images_NHW3: np.ndarray,
        labels_N: Sequence[int] | np.ndarray,
        *,
        augment: bool,
        seed: int = 0,
        mean: Sequence[float] = CIFAR10_MEAN,
        std: Sequence[float] = CIFAR10_STD,
    ) -> None:
        assert images_NHW3.dtype == np.uint8 and images_NHW3.ndim == 4 and images_NHW3.shape[3] == 3, (
            f"expected uint8 (N, H, W, 3) images, got {images_NHW3.dtype} {images_NHW3.shape}"
        )
        self.images_NHW3 = images_NHW3
        self.labels_N = torch.as_tensor(np.asarray(labels_N), dtype=torch.int64)
        assert len(self.labels_N) == len(images_NHW3), "one label per image"
        self.augment = augment
        self.seed = seed
        self.mean_311 = torch.tensor(mean, dtype=torch.float64).view(3, 1, 1)
        self.std_311 = torch.tensor(std, dtype=torch.float64).view(3, 1, 1)
        self._epoch = EpochCounter()

    @classmethod
    def from_cifar10(cls, raw: CIFAR10, *, augment: bool, seed: int = 0) -> CifarAugmentDataset:
        """Wraps a dataset from `load_cifar10` (uses its `.data` and `.targets`)."""
        return cls(raw.data, raw.targets, augment=augment, seed=seed)

    @property
    def epoch(self) -> int:
        """The epoch whose augmentation `__getitem__` currently draws."""
        return self._epoch.get()

    def set_epoch(self, epoch: int) -> None:
        """Selects the epoch for the augmentation draws (visible to already-started workers too)."""
        assert epoch >= 0, f"epoch must be >= 0, got {epoch}"
        self._epoch.set(epoch)

    def __len__(self) -> int:
        return len(self.images_NHW3)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        """Returns {"image": (3, H, W) normalised in the default dtype (float32), "label": int64 scalar}."""
        img_3HW = torch.from_numpy(self.images_NHW3[index]).permute(2, 0, 1)
        if self.augment:
            top, left, flip = augment_params(self.seed, self.epoch, index)
            img_3HW = pad_crop_flip(img_3HW, top, left, flip)
        dtype = torch.get_default_dtype()
        x_3HW = img_3HW.to(dtype).div_(255.0).sub_(self.mean_311.to(dtype)).div_(self.std_311.to(dtype))
        return {"image": x_3HW, "label": self.labels_N[index].clone()}
