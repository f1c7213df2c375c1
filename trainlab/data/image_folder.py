"""ImageNet-layout image folders (`root/<class name>/**/<image>`) with VAR's official preprocessing.

Layout: every sub-folder of `root` is a class; class ids are the sorted folder names' positions (as torchvision's
`ImageFolder`), images are found recursively under each class folder. Files whose extension is not an image
extension (`IMAGE_EXTENSIONS`) are ignored at scan time and counted once.

Preprocessing (official `utils/data.py: build_dataset`), for an image side R:
    resize the shorter side to round(1.125 * R) with LANCZOS (aspect ratio kept; 256 -> 288)
    train: RandomCrop(R)    val: CenterCrop(R)
    optional horizontal flip (train only, off by default as in the official runs)
    ToTensor (uint8 -> [0, 1]), then x -> x + x - 1 (into [-1, 1])

Determinism: the crop offsets and the flip of sample i in epoch e are a pure function of (seed, e, i)
(`trainlab.data.augment.augment_draws`, no global RNG), so a resumed run, or one with a different number of loader
workers, sees the same pixels. Call `set_epoch(e)` before iterating the loader for epoch e (the engine does).

Unreadable images: a file that fails to decode (truncated JPEG, not really an image, permission error...) is never
fatal mid-epoch. Sample i is replaced by the next readable index i+1, i+2, ... (wrapping around), the same way every
time, and the skip is counted (`skipped_images`, shared with the loader workers) and warned about once per file.
Only `MAX_CONSECUTIVE_UNREADABLE` unreadable files in a row stop the run (the folder is then clearly broken).
"""

# Shape legend: 3 RGB channels, H/W image side (R after cropping).

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torchvision.transforms.functional as TF
from PIL import Image
from torch.utils.data import Dataset, get_worker_info
from torchvision.transforms import InterpolationMode

from trainlab.data.augment import EpochCounter, FlipMode, augment_draws, decide_flip, mixed_radix_digits
from trainlab.errors import UsageError

log = logging.getLogger(__name__)

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
RESIZE_RATIO = 1.125  # official: mid_reso = round(1.125 * final_reso)
MAX_CONSECUTIVE_UNREADABLE = 64
_MAX_WORKER_SLOTS = 256  # skip counters: slot 0 = main process, slot w+1 = loader worker w

CropMode = Literal["random", "center"]


@dataclass(frozen=True)
class FolderIndex:
    """What a scan of an image folder found.

    Attributes:
        root: the scanned folder.
        classes: class (sub-folder) names, sorted; the class id is the position.
        files: (path relative to root, class id) per image, sorted by class then path.
        ignored_files: files skipped at scan time because their extension is not an image extension.
    """

    root: Path
    classes: tuple[str, ...]
    files: tuple[tuple[str, int], ...]
    ignored_files: int

    def listing_sha256(self) -> str:
        """A hash of the class names and relative file paths (detects a changed folder of the same size)."""
        h = hashlib.sha256()
        for name in self.classes:
            h.update(b"c" + name.encode() + b"\0")
        for rel, cls in self.files:
            h.update(f"{cls}:{rel}".encode() + b"\0")
        return h.hexdigest()


def scan_image_folder(root: str | Path) -> FolderIndex:
    """List the images of an ImageNet-layout folder.

    Args:
        root: folder with one sub-folder per class (e.g. `imagenet/train`).

    Returns:
        The sorted class names and (relative path, class id) of every image file.

    Raises:
        UsageError: the folder is missing, has no class sub-folders, or holds no image file.
    """
    root = Path(root).expanduser()
    if not root.is_dir():
        raise UsageError(f"image folder {root} not found; pass --data-root with train/ and val/ class sub-folders")
    classes = tuple(
        sorted(entry.name for entry in os.scandir(root) if entry.is_dir() and not entry.name.startswith("."))
    )
    if not classes:
        raise UsageError(
            f"image folder {root} has no class sub-folders; expected {root}/<class name>/<image> (ImageNet layout)"
        )
    files: list[tuple[str, int]] = []
    ignored = 0
    for class_id, name in enumerate(classes):
        class_dir = root / name
        found: list[str] = []
        for dirpath, dirnames, filenames in os.walk(class_dir, followlinks=True):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            for filename in filenames:
                if filename.startswith("."):
                    continue
                if filename.lower().endswith(IMAGE_EXTENSIONS):
                    found.append(os.path.relpath(os.path.join(dirpath, filename), root))
                else:
                    ignored += 1
        files.extend((rel, class_id) for rel in sorted(found))
    if not files:
        raise UsageError(f"image folder {root} has class sub-folders but no images ({', '.join(IMAGE_EXTENSIONS)})")
    if ignored:
        log.warning("%s: ignored %d file(s) that are not images (by extension)", root, ignored)
    return FolderIndex(root=root, classes=classes, files=tuple(files), ignored_files=ignored)


def preprocess(
    img: Image.Image,
    image_size: int,
    *,
    crop: CropMode,
    flip: FlipMode,
    draws: tuple[int, int] = (0, 0),
) -> torch.Tensor:
    """The official VAR preprocessing of one PIL image.

    Args:
        img: an RGB PIL image.
        image_size: R, the output side.
        crop: "random" (offsets from `draws[0]`) or "center".
        flip: "none", "random" (from `draws[1]`) or "always".
        draws: two 64-bit words from `augment_draws(seed, epoch, index)` for the random choices.

    Returns:
        float32 (3, R, R) in [-1, 1].
    """
    mid = round(RESIZE_RATIO * image_size)
    img = TF.resize(img, mid, interpolation=InterpolationMode.LANCZOS)
    if crop == "random":
        w, h = img.size
        span_h, span_w = h - image_size + 1, w - image_size + 1
        top, left = mixed_radix_digits(draws[0], span_h, span_w)
        img = TF.crop(img, top, left, image_size, image_size)
    else:
        img = TF.center_crop(img, [image_size, image_size])
    if decide_flip(flip, draws):
        img = TF.hflip(img)
    x_3HW = TF.to_tensor(img)
    return x_3HW.add(x_3HW).add_(-1.0)


class ImageFolderDataset(Dataset[dict[str, torch.Tensor]]):
    """An ImageNet-layout folder as `{"image": (3, R, R) float32 in [-1, 1], "label": int64}` samples.

    Args:
        root: folder with one sub-folder per class.
        image_size: R.
        train: random crop (and flip if `horizontal_flip`); False gives the center crop, no flip (validation).
        horizontal_flip: random horizontal flip in training (official `--hflip`, default off).
        seed: data seed; the random crop/flip of sample i in epoch e depends only on (seed, e, i).
        flip: override the flip mode ("always" builds the mirrored variant of a token cache).
        index: a previous scan of `root` (skips re-scanning).
    """

    def __init__(
        self,
        root: str | Path,
        *,
        image_size: int,
        train: bool,
        horizontal_flip: bool = False,
        seed: int = 0,
        flip: FlipMode | None = None,
        index: FolderIndex | None = None,
    ) -> None:
        self.index = index if index is not None else scan_image_folder(root)
        self.root = self.index.root
        self.classes = self.index.classes
        self.image_size = image_size
        self.crop: CropMode = "random" if train else "center"
        self.flip: FlipMode = flip if flip is not None else ("random" if train and horizontal_flip else "none")
        self.seed = seed
        self._epoch = EpochCounter()
        self._skips = torch.zeros(_MAX_WORKER_SLOTS + 1, dtype=torch.int64).share_memory_()
        self._warned: set[str] = set()

    @property
    def num_classes(self) -> int:
        """Number of class sub-folders."""
        return len(self.classes)

    @property
    def epoch(self) -> int:
        """The epoch whose augmentation `__getitem__` currently draws."""
        return self._epoch.get()

    @property
    def skipped_images(self) -> int:
        """Unreadable images replaced since the last `set_epoch` (all loader workers together)."""
        return int(self._skips.sum().item())

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch of the augmentation draws; logs and resets the previous epoch's skip count."""
        skipped = self.skipped_images
        if skipped:
            log.warning(
                "%s: epoch %d replaced %d unreadable image(s) by the next readable one", self.root, self.epoch, skipped
            )
        self._skips.zero_()
        self._epoch.set(epoch)

    def __len__(self) -> int:
        return len(self.index.files)

    def _load(self, position: int) -> Image.Image:
        rel, _ = self.index.files[position]
        with Image.open(self.root / rel) as img:
            return img.convert("RGB")  # decodes fully: a truncated file fails here, not later

    def _count_skip(self, position: int, err: BaseException) -> None:
        info = get_worker_info()
        slot = 0 if info is None else 1 + info.id % _MAX_WORKER_SLOTS
        self._skips[slot] += 1
        rel = self.index.files[position][0]
        if rel not in self._warned:
            self._warned.add(rel)
            detail = " ".join(str(err).split())[:120]
            log.warning("skipping unreadable image %s (%s: %s)", self.root / rel, type(err).__name__, detail)

    def _position(self, index: int) -> int:
        """The listing position of sample `index` (subclasses may show a subset of the listing)."""
        return index

    def _transform(self, img: Image.Image, index: int) -> torch.Tensor:
        """Resize, crop and flip one decoded image (sample `index`'s draws for the current epoch)."""
        draws = (
            augment_draws(self.seed, self.epoch, index) if (self.crop == "random" or self.flip == "random") else (0, 0)
        )
        return preprocess(img, self.image_size, crop=self.crop, flip=self.flip, draws=draws)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        n = len(self.index.files)
        first = self._position(index)
        for offset in range(MAX_CONSECUTIVE_UNREADABLE):
            position = (first + offset) % n
            try:
                img = self._load(position)
            except Exception as err:  # any decoder failure of a user's file is a skip, never a crash mid-epoch
                self._count_skip(position, err)
                continue
            label = torch.tensor(self.index.files[position][1], dtype=torch.int64)
            return {"image": self._transform(img, index), "label": label}
        raise UsageError(
            f"{MAX_CONSECUTIVE_UNREADABLE} unreadable images in a row in {self.root} from "
            f"{self.index.files[first][0]}; check the dataset copy (truncated download?)"
        )

    def describe(self) -> dict[str, Any]:
        """What identifies this dataset's content (for token-cache fingerprints)."""
        return {
            "kind": "image-folder",
            "size": len(self),
            "num_classes": self.num_classes,
            "listing_sha256": self.index.listing_sha256(),
            "image_size": self.image_size,
            "crop": self.crop,
            "flip": self.flip,
        }
