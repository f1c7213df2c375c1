"""CIFAR-10: reading the python-pickle release safely, and the standard train-time augmentation.

Two pieces:
- `load_cifar10` reads one split into a `Cifar10Split` (`.data` uint8 (N, 32, 32, 3), `.targets`, `.classes`: the
  arrays torchvision's `CIFAR10` holds) and turns every way the data can be missing, broken or foreign into a
  one-line `UsageError` naming the file.
- `CifarAugmentDataset` applies the kuangliu/airbench recipe (`trainlab.data.transforms.pad_crop_flip`: random
  32x32 crop of the 4-pixel zero-padded image, horizontal flip with p=0.5; then per-channel normalisation). Its
  randomness is a pure function of (seed, epoch, sample index), so a run resumed at any step, with any number of
  loader workers, sees exactly the same augmented pixels as an uninterrupted run.

No file runs code. The release's files are pickles, and a plain `pickle.load` (what torchvision's `CIFAR10` does)
runs whatever callable a file names: a poisoned `data_batch_1` executes code the moment it is read. Here the files go
through `_CifarUnpickler`, which admits only what the official files contain (numpy's array reconstruction,
`numpy.ndarray`, `numpy.dtype`; dicts, lists, ints and strings need no callable) plus what Python 3 writes for `bytes`
at protocol 2 (how `trainlab.data.fake_cifar` writes): the latin-1 `_codecs.encode` and, for an empty `bytes`, a
`bytes()` without argument; and numpy's `_frombuffer`, how an array is pickled at protocol 5 (an array of a plain
dtype from its bytes). Anything else is refused before it is called. The content is then checked: a dict with
`data` uint8 (n, 3072) and `labels`, n integers in [0, 10); `batches.meta` with the 10 `label_names`; no empty
split. The official files were pickled by Python 2; they are read with `encoding="latin1"`, as torchvision does, so
keys come back as `str`.

`download=True` fetches the official archive with torchvision's downloader, which checks its md5, then reads the
extracted files the same way.

Normalisation constants: mean (0.4914, 0.4822, 0.4465) and std (0.2470, 0.2435, 0.2616) are the per-channel mean
and standard deviation over all 50,000 training images (the values airbench uses). kuangliu/pytorch-cifar uses std
(0.2023, 0.1994, 0.2010), the average of per-image standard deviations, which is smaller and leaves the inputs with
a standard deviation of about 1.22 rather than 1. Both train fine behind BatchNorm; we pick the one that actually
standardises the data.
"""

# Shape legend: N dataset size, H/W height/width (32), 3 RGB channels.

from __future__ import annotations

import codecs
import hashlib
import logging
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset
from torchvision.datasets.utils import download_and_extract_archive

from trainlab.data.augment import EpochCounter
from trainlab.data.transforms import pad_crop_flip, pad_crop_flip_draws
from trainlab.errors import UsageError, missing_file

log = logging.getLogger(__name__)

CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
CIFAR10_NUM_CLASSES = 10

# The official release (https://www.cs.toronto.edu/~kriz/cifar.html); names and md5s as torchvision lists them.
CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
CIFAR10_ARCHIVE = "cifar-10-python.tar.gz"
CIFAR10_ARCHIVE_MD5 = "c58f30108f718f92721af3b95e74349a"
CIFAR10_DIRNAME = "cifar-10-batches-py"
CIFAR10_TRAIN_FILES = (
    ("data_batch_1", "c99cafc152244af753f735de768cd75f"),
    ("data_batch_2", "d4bba439e000b95fd0a9bffe97cbabec"),
    ("data_batch_3", "54ebc095f3ab1f0389bbae665268c751"),
    ("data_batch_4", "634d18415352ddfa80567beed471001a"),
    ("data_batch_5", "482c414d41f54cd18b22e5b47cb7c3cb"),
)
CIFAR10_TEST_FILES = (("test_batch", "40351d587109b95175f43aff81a1287e"),)
CIFAR10_META_FILE = ("batches.meta", "5ff9c542aee3614f3951f8cda6e48888")
_PIXELS_PER_IMAGE = 3 * 32 * 32


@dataclass(frozen=True, eq=False)
class Cifar10Split:
    """One split of CIFAR-10 as `load_cifar10` read and checked it.

    Attributes:
        data: uint8 (N, 32, 32, 3) images (a channels-last view, as torchvision's `CIFAR10.data`).
        targets: N class ids in [0, 10).
        classes: the 10 class names of `batches.meta`.
    """

    data: np.ndarray
    targets: list[int]
    classes: list[str]

    def __len__(self) -> int:
        return len(self.targets)


def load_cifar10(
    root: str | Path, *, train: bool, download: bool = False, verify_checksums: bool = False
) -> Cifar10Split:
    """Reads one split of CIFAR-10 stored as `<root>/cifar-10-batches-py`, without running code from the files.

    Args:
        root: directory that contains (or, with `download`, will contain) `cifar-10-batches-py/`, or that folder
            itself.
        train: the 50,000-image training split if True, else the 10,000-image test split.
        download: fetch and extract the official archive (md5-checked) if the files are not there yet.
        verify_checksums: also compare every file with the official md5 (slow-ish; fails on fake data).

    Returns:
        The split's images, labels and class names.

    Raises:
        UsageError: data missing (and `download` is False), incomplete, unreadable, corrupt, holding something other
            than CIFAR-10 data (such as a pickle that would run code), an empty split, or the download failed.
    """
    root = Path(root).expanduser()
    folder = root / CIFAR10_DIRNAME
    if not folder.is_dir() and root.name == CIFAR10_DIRNAME and root.is_dir():
        folder = root  # --data.root names the batches folder itself, not the folder holding it
    if download and _missing(folder):
        try:
            download_and_extract_archive(CIFAR10_URL, root, filename=CIFAR10_ARCHIVE, md5=CIFAR10_ARCHIVE_MD5)
        except (OSError, RuntimeError) as e:  # URLError is an OSError; a bad archive md5 is a RuntimeError
            raise UsageError(
                f"could not download CIFAR-10 into {root} ({_one_line(e)}); check the network, "
                f"or fetch {CIFAR10_URL} yourself, extract it there and drop --data.download"
            ) from e
    if not folder.is_dir():
        raise UsageError(
            f"CIFAR-10 not found under {root} (expected {folder}); pass --data.download to fetch it, "
            "or --data.root to point at it"
        )
    missing = _missing(folder)
    in_the_way = [name for name in missing if (folder / name).exists() or (folder / name).is_symlink()]
    if in_the_way:  # not missing: a FIFO, a folder, a device or a broken link has the file's name
        path = folder / in_the_way[0]
        raise UsageError(
            f"CIFAR-10 under {root}: {path} {missing_file(path)}; put the archive's file there, or delete {folder} "
            "and pass --data.download to fetch it again"
        )
    if missing:
        raise UsageError(
            f"CIFAR-10 under {root} is incomplete (missing {', '.join(missing)} in {folder}); "
            "delete that folder and pass --data.download to fetch it again"
        )
    if verify_checksums:
        for name, md5 in (*CIFAR10_TRAIN_FILES, *CIFAR10_TEST_FILES, CIFAR10_META_FILE):
            if _md5(folder / name) != md5:
                raise UsageError(
                    f"CIFAR-10 file {folder / name} does not match the official md5; "
                    "delete that folder and pass --data.download to fetch it again"
                )
    images: list[np.ndarray] = []
    targets: list[int] = []
    for name, _md5sum in CIFAR10_TRAIN_FILES if train else CIFAR10_TEST_FILES:
        batch_images, batch_labels = _read_batch(folder / name)
        images.append(batch_images)
        targets.extend(batch_labels)
    if not targets:
        names = [name for name, _md5sum in (CIFAR10_TRAIN_FILES if train else CIFAR10_TEST_FILES)]
        raise UsageError(
            f"CIFAR-10 under {folder} has no {'training' if train else 'test'} images (none in {', '.join(names)}); "
            "delete that folder and pass --data.download to fetch it again"
        )
    classes = _read_meta(folder / CIFAR10_META_FILE[0])
    data = np.vstack(images).reshape(-1, 3, 32, 32).transpose((0, 2, 3, 1))  # rows of R, G, B planes -> HWC
    log.info("loaded CIFAR-10 %s split: %d images from %s", "train" if train else "test", len(targets), folder)
    return Cifar10Split(data=data, targets=targets, classes=classes)


def _missing(folder: Path) -> list[str]:
    names = [name for name, _md5 in (*CIFAR10_TRAIN_FILES, *CIFAR10_TEST_FILES, CIFAR10_META_FILE)]
    return [name for name in names if not (folder / name).is_file()]


def _md5(path: Path) -> str:
    digest = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class _Refused(pickle.UnpicklingError):
    """A pickle asked for a callable that CIFAR-10 files never contain."""


def _latin1_encode(text: str, encoding: str = "utf-8") -> bytes:
    """`_codecs.encode` as Python 3 pickles `bytes` at protocol 2 (`encode(text, "latin1")`), and nothing else."""
    if not isinstance(text, str) or codecs.lookup(encoding).name != "iso8859-1":
        raise _Refused(f"_codecs.encode with {encoding!r} is not how bytes are pickled")
    return text.encode("latin-1")


def _array_from_buffer(
    buf: object, dtype: object, shape: object, order: object, axis_order: object = None
) -> np.ndarray:
    """numpy's `_frombuffer`, as numpy pickles an array at protocol 5: the bytes of one array of a plain dtype,
    reshaped; anything else (an object dtype, a shape or order of another type) is refused."""
    if not isinstance(buf, (bytes, bytearray, pickle.PickleBuffer)) or not isinstance(dtype, np.dtype):
        raise _Refused("numpy._frombuffer with arguments other than an array's bytes and dtype")
    if dtype.hasobject or not isinstance(shape, tuple) or not all(type(n) is int and n >= 0 for n in shape):
        raise _Refused(f"numpy._frombuffer of {dtype} {shape!r}")
    array = np.frombuffer(buf.raw() if isinstance(buf, pickle.PickleBuffer) else buf, dtype=dtype)
    if order == "K" and isinstance(axis_order, tuple) and all(type(axis) is int for axis in axis_order):
        return array.reshape(shape, order="C").transpose(axis_order)
    if order not in ("C", "F") or axis_order is not None:
        raise _Refused(f"numpy._frombuffer with order {order!r}")
    return array.reshape(shape, order="F" if order == "F" else "C")


def _empty_bytes() -> bytes:
    """`bytes()`, as Python 3 pickles an empty `bytes` at protocol 2 (`__builtin__.bytes` with no argument)."""
    return b""


_RECONSTRUCT: Callable[..., Any] = np.zeros(0).__reduce__()[0]  # type: ignore[assignment]  # numpy 1.x or 2.x
_ALLOWED: dict[tuple[str, str], Callable[..., Any]] = {
    ("numpy.core.multiarray", "_reconstruct"): _RECONSTRUCT,  # how numpy 1.x (and Python 2) names it
    ("numpy._core.multiarray", "_reconstruct"): _RECONSTRUCT,  # numpy >= 2
    ("numpy.core.numeric", "_frombuffer"): _array_from_buffer,  # protocol 5 (numpy 1.x names)
    ("numpy._core.numeric", "_frombuffer"): _array_from_buffer,  # protocol 5 (numpy >= 2)
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
    ("_codecs", "encode"): _latin1_encode,
    ("__builtin__", "bytes"): _empty_bytes,  # the protocol-2 name; the pickle module maps it to builtins
    ("builtins", "bytes"): _empty_bytes,
}


class _CifarUnpickler(pickle.Unpickler):
    """An unpickler that resolves only the callables of `_ALLOWED` (see the module docstring)."""

    def find_class(self, module: str, name: str) -> Any:
        allowed = _ALLOWED.get((module, name))
        if allowed is None:
            raise _Refused(f"it asks for {module}.{name}, which CIFAR-10 files never contain")
        return allowed


def _unpickle(path: Path) -> Any:
    try:
        with open(path, "rb") as f:
            return _CifarUnpickler(f, encoding="latin1").load()
    except _Refused as e:
        raise _foreign(path, str(e)) from None
    except Exception as e:  # only admitted callables ran: anything else is a damaged stream
        raise _corrupt(path, _one_line(e)) from None


def _read_batch(path: Path) -> tuple[np.ndarray, list[int]]:
    """A `data_batch_*` / `test_batch` file: uint8 (n, 3072) images and n labels in [0, 10)."""
    entry = _unpickle(path)
    if not isinstance(entry, dict) or "data" not in entry or "labels" not in entry:
        found = sorted(map(str, entry)) if isinstance(entry, dict) else type(entry).__name__
        raise _foreign(path, f"expected a dict with 'data' and 'labels', found {found}")
    data, labels = entry["data"], entry["labels"]
    if type(data) is not np.ndarray or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != _PIXELS_PER_IMAGE:
        found = f"{data.dtype} {data.shape}" if isinstance(data, np.ndarray) else type(data).__name__
        raise _foreign(path, f"'data' is {found}, expected uint8 (n, {_PIXELS_PER_IMAGE})")
    checked = _labels(path, labels)
    if len(checked) != data.shape[0]:
        raise _foreign(path, f"{data.shape[0]} images but {len(checked)} labels")
    return data, checked


def _labels(path: Path, labels: object) -> list[int]:
    if isinstance(labels, np.ndarray) and labels.ndim == 1 and np.issubdtype(labels.dtype, np.integer):
        values = [int(y) for y in labels]
    elif isinstance(labels, (list, tuple)):
        bad = next((y for y in labels if type(y) is not int), None)
        if bad is not None:
            raise _foreign(path, f"labels must be integers in [0, {CIFAR10_NUM_CLASSES}), found {bad!r}")
        values = list(labels)
    else:
        raise _foreign(path, f"'labels' is {type(labels).__name__}, expected a list of integers")
    out_of_range = next((y for y in values if not 0 <= y < CIFAR10_NUM_CLASSES), None)
    if out_of_range is not None:
        raise _foreign(path, f"labels must be integers in [0, {CIFAR10_NUM_CLASSES}), found {out_of_range}")
    return values


def _read_meta(path: Path) -> list[str]:
    """`batches.meta`: the 10 class names under `label_names`."""
    meta = _unpickle(path)
    names = meta.get("label_names") if isinstance(meta, dict) else None
    if not isinstance(names, list) or len(names) != CIFAR10_NUM_CLASSES or not all(isinstance(n, str) for n in names):
        raise _foreign(path, f"expected {CIFAR10_NUM_CLASSES} class names under 'label_names'")
    return names


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())[:200]
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _corrupt(path: Path, detail: str) -> UsageError:
    return UsageError(
        f"CIFAR-10 file {path} is corrupt or unreadable ({detail}); "
        "delete that folder and pass --data.download to fetch it again"
    )


def _foreign(path: Path, detail: str) -> UsageError:
    return UsageError(
        f"CIFAR-10 file {path} holds something other than CIFAR-10 data ({detail}); "
        "delete that folder and pass --data.download to fetch it again"
    )


class CifarAugmentDataset(Dataset[dict[str, torch.Tensor]]):
    """CIFAR images as normalised float tensors, with deterministic per-(seed, epoch, index) augmentation.

    Call `set_epoch(epoch)` before iterating the loader for that epoch (before `iter(loader)`). The epoch is an
    `EpochCounter` (shared memory), so the update reaches worker processes even with `persistent_workers=True`.

    Args:
        images_NHW3: uint8 images, (N, H, W, 3), e.g. `Cifar10Split.data`.
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
    def from_cifar10(cls, raw: Cifar10Split, *, augment: bool, seed: int = 0) -> CifarAugmentDataset:
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
            top, left, flip = pad_crop_flip_draws(self.seed, self.epoch, index)
            img_3HW = pad_crop_flip(img_3HW, top, left, flip)
        dtype = torch.get_default_dtype()
        x_3HW = img_3HW.to(dtype).div_(255.0).sub_(self.mean_311.to(dtype)).div_(self.std_311.to(dtype))
        return {"image": x_3HW, "label": self.labels_N[index].clone()}
