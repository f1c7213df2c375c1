"""ImageNet-layout image folders (`root/<class name>/**/<image>`) with VAR's official preprocessing.

Layout: every sub-folder of `root` is a class; class ids are the sorted folder names' positions (as torchvision's
`ImageFolder`), images are found recursively under each class folder. Files whose extension is not an image
extension (`IMAGE_EXTENSIONS`) are ignored at scan time and counted once.

Scanning (`scan_image_folder`, the one scanner of every recipe): only regular files are listed (a FIFO, socket or
device named `*.png` is left out: opening a FIFO blocks). Symbolic links are followed, but each real file is listed
once and each real directory walked once: links to directories are followed after every real directory, so a file
is listed under its own path when it has one, and a link back up the tree (a loop) is not walked again. The listing
is sorted, so it does not depend on the order the file system returns entries. Entries left out are counted by
reason in one log line.

Preprocessing (`trainlab.data.transforms.var_resize_crop`, official `utils/data.py: build_dataset`), for a side R:
    resize the shorter side to round(1.125 * R) with LANCZOS (aspect ratio kept; 256 -> 288)
    train: RandomCrop(R)    val: CenterCrop(R)
    optional horizontal flip (train only, off by default as in the official runs)
    ToTensor (uint8 -> [0, 1]), then x -> x + x - 1 (into [-1, 1])

Determinism: the crop offsets and the flip of sample i in epoch e are a pure function of (seed, e, i)
(`trainlab.data.augment.augment_draws`, no global RNG), so a resumed run, or one with a different number of loader
workers, sees the same pixels. Call `set_epoch(e)` before iterating the loader for epoch e (the engine does).

Unreadable images: images are read by `trainlab.data.images.read_image` (regular files only, a pixel limit against
decompression bombs, plain raster formats). A file it refuses (truncated JPEG, not really an image, a bomb, a
permission error...) is never fatal mid-epoch: sample i is replaced by the next readable index i+1, i+2, ...
(wrapping around), the same way every time, and the skip is counted (`skipped_images`, shared with the loader
workers) and warned about once per file, with the count so far. `MAX_CONSECUTIVE_UNREADABLE` unreadable files in a
row, or a folder of which no image is readable, stop the run with one line (`DataError`, the same with or without
loader workers). `UnreadableSkipper` holds these rules for every folder dataset (VAR, tokenizer, MoCo, linear probe).
"""

# Shape legend: 3 RGB channels, H/W image side (R after cropping).

from __future__ import annotations

import functools
import hashlib
import logging
import os
import stat
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from PIL import Image
from torch.utils.data import Dataset, get_worker_info

from trainlab.data.augment import EpochCounter, FlipMode, augment_draws
from trainlab.data.errors import DataError
from trainlab.data.images import UnreadableImage, read_image, read_image_pixels
from trainlab.data.transforms import RESIZE_RATIO, CropMode, var_resize_crop
from trainlab.errors import UsageError

log = logging.getLogger(__name__)

T = TypeVar("T")

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp", ".gif")
MAX_CONSECUTIVE_UNREADABLE = 64
_MAX_WORKER_SLOTS = 256  # skip counters: slot 0 = main process, slot w+1 = loader worker w

# Why a scan leaves an entry out (the keys of `FolderIndex.skipped`).
SKIP_NOT_REGULAR = "not a regular file (FIFO, socket or device)"
SKIP_BROKEN = "broken link or unreadable entry"
SKIP_UNREADABLE_DIR = "unreadable directory"
SKIP_DUPLICATE_FILE = "another path to a file already listed (symbolic link)"
SKIP_REVISITED_DIR = "link to a directory already walked (symbolic link loop or duplicate)"


@dataclass(frozen=True)
class FolderIndex:
    """What a scan of an image folder found.

    Attributes:
        root: the scanned folder.
        classes: class (sub-folder) names, sorted; the class id is the position.
        files: (path relative to root, class id) per image, sorted by class then path.
        ignored_files: files skipped at scan time because their extension is not an image extension.
        skipped: (reason, count) of the other entries the scan left out, one of the `SKIP_*` reasons each.
    """

    root: Path
    classes: tuple[str, ...]
    files: tuple[tuple[str, int], ...]
    ignored_files: int
    skipped: tuple[tuple[str, int], ...] = ()

    def listing_sha256(self) -> str:
        """A hash of the class names and relative file paths (detects a changed folder of the same size)."""
        h = hashlib.sha256()
        for name in self.classes:
            h.update(b"c" + os.fsencode(name) + b"\0")
        for rel, cls in self.files:
            h.update(f"{cls}:".encode() + os.fsencode(rel) + b"\0")
        return h.hexdigest()


def scan_image_folder(root: str | Path) -> FolderIndex:
    """List the images of an ImageNet-layout folder (the rules are in the module docstring).

    Args:
        root: folder with one sub-folder per class (e.g. `imagenet/train`).

    Returns:
        The sorted class names and (relative path, class id) of every image file, each real file once.

    Raises:
        UsageError: the folder is missing or unreadable, has no class sub-folders, or holds no image file.
    """
    root = Path(root).expanduser()
    if not root.is_dir():
        raise UsageError(f"image folder {root} not found; pass --data.root with train/ and val/ class sub-folders")
    classes = list_classes(root)
    if not classes:
        raise UsageError(
            f"image folder {root} has no class sub-folders; expected {root}/<class name>/<image> (ImageNet layout)"
        )
    scan = _Scan(root)
    for class_id, name in enumerate(classes):
        scan.walk_class(class_id, name)
    scan.follow_directory_links()
    files = scan.listing(len(classes))
    if not files:
        raise UsageError(f"image folder {root} has class sub-folders but no images ({', '.join(IMAGE_EXTENSIONS)})")
    if scan.ignored:
        log.warning("%s: ignored %d file(s) that are not images (by extension)", root, scan.ignored)
    if scan.skipped:
        log.warning(
            "%s: left out %d entr%s: %s",
            root,
            sum(scan.skipped.values()),
            "y" if sum(scan.skipped.values()) == 1 else "ies",
            ", ".join(f"{count} {reason}" for reason, count in sorted(scan.skipped.items())),
        )
    return FolderIndex(
        root=root,
        classes=classes,
        files=files,
        ignored_files=scan.ignored,
        skipped=tuple(sorted(scan.skipped.items())),
    )


def list_classes(root: str | Path) -> tuple[str, ...]:
    """The class names of an image folder: its sub-folders not starting with '.', sorted (no image is listed).

    Raises:
        UsageError: the folder cannot be read.
    """
    try:
        with os.scandir(Path(root).expanduser()) as entries:
            return tuple(sorted(e.name for e in entries if not e.name.startswith(".") and e.is_dir()))
    except OSError as err:
        raise UsageError(f"image folder {root} cannot be read ({err.strerror}); check its permissions") from None


class _Scan:
    """One scan's state: real directories walked, real files listed, directory links still to follow."""

    def __init__(self, root: Path) -> None:
        self.root = root
        real_root = os.path.realpath(root)
        self.walked: set[str] = {real_root}  # real paths of walked directories (the root: a link to it is a loop)
        self.listed: dict[str, tuple[bool, int, str]] = {}  # real file path -> (reached by a link, class id, rel)
        self.links: deque[tuple[int, str]] = deque()  # (class id, path relative to root) of directory links
        self.skipped: Counter[str] = Counter()
        self.ignored = 0

    def walk_class(self, class_id: int, name: str) -> None:
        """Walk one class folder (itself possibly a link: a class folder is walked wherever it points)."""
        real = os.path.realpath(self.root / name)
        if real in self.walked:
            self.skipped[SKIP_REVISITED_DIR] += 1
            return
        self.walked.add(real)
        self._walk(class_id, name, real, by_link=False)

    def follow_directory_links(self) -> None:
        """Walk the directory links found so far (and those found inside them), each real directory once."""
        while self.links:
            class_id, rel = self.links.popleft()
            real = os.path.realpath(self.root / rel)
            if real in self.walked:
                self.skipped[SKIP_REVISITED_DIR] += 1
                continue
            self.walked.add(real)
            self._walk(class_id, rel, real, by_link=True)

    def listing(self, num_classes: int) -> tuple[tuple[str, int], ...]:
        """(rel, class id) of every listed file, sorted by class then path."""
        per_class: list[list[str]] = [[] for _ in range(num_classes)]
        for _by_link, class_id, rel in self.listed.values():
            per_class[class_id].append(rel)
        return tuple((rel, class_id) for class_id, rels in enumerate(per_class) for rel in sorted(rels))

    def _walk(self, class_id: int, top: str, real_top: str, *, by_link: bool) -> None:
        pending = [(top, real_top)]  # (path relative to root, real path) of directories to list
        while pending:
            rel_dir, real_dir = pending.pop()
            try:
                with os.scandir(self.root / rel_dir) as it:
                    entries = sorted(it, key=lambda e: e.name)
            except OSError:
                self.skipped[SKIP_UNREADABLE_DIR] += 1
                continue
            for entry in entries:
                if entry.name.startswith("."):
                    continue
                rel = os.path.join(rel_dir, entry.name)
                try:
                    is_link = entry.is_symlink()
                    mode = entry.stat().st_mode  # follows a link: the kind of what it points to
                except OSError:
                    self.skipped[SKIP_BROKEN] += 1
                    continue
                if stat.S_ISDIR(mode) and is_link:
                    self.links.append((class_id, rel))  # followed after every real directory
                elif stat.S_ISDIR(mode):
                    real_sub = os.path.join(real_dir, entry.name)
                    self.walked.add(real_sub)
                    pending.append((rel, real_sub))
                elif not entry.name.lower().endswith(IMAGE_EXTENSIONS):
                    self.ignored += 1
                elif not stat.S_ISREG(mode):
                    self.skipped[SKIP_NOT_REGULAR] += 1
                else:
                    real = os.path.realpath(entry.path) if is_link else os.path.join(real_dir, entry.name)
                    self._list(real, (by_link or is_link, class_id, rel))

    def _list(self, real: str, candidate: tuple[bool, int, str]) -> None:
        """Keep one path per real file: the one reached without a link, then the first by class and path."""
        kept = self.listed.get(real)
        if kept is not None:
            self.skipped[SKIP_DUPLICATE_FILE] += 1
            candidate = min(kept, candidate)
        self.listed[real] = candidate


def evenly_spaced(num_items: int, limit: int) -> tuple[int, ...]:
    """Positions of `limit` items evenly spaced over all `num_items` (all of them when `limit` is 0 or larger):
    position i * num_items // limit, so a class-sorted folder listing is sampled from its first class to its last,
    each class in proportion to its size (a class of at least num_items / limit images always keeps one)."""
    keep = num_items if limit <= 0 else min(limit, num_items)
    return tuple(i * num_items // keep for i in range(keep))


class UnreadableSkipper:
    """Reads a folder's images by listing position, replacing an unreadable one by the next readable position.

    The skip rules of every folder dataset (module docstring): the replacement of position p is the first readable
    position p+1, p+2, ... (wrapping around), the same every time; each skip is counted in shared memory (so loader
    workers add to the same count) and warned about once per file and process.

    Args:
        index: the scanned folder.
    """

    def __init__(self, index: FolderIndex) -> None:
        self.index = index
        self._skips = torch.zeros(_MAX_WORKER_SLOTS + 1, dtype=torch.int64).share_memory_()
        self._warned: set[str] = set()

    @property
    def skipped(self) -> int:
        """Unreadable images replaced since the last `reset` (all loader workers together)."""
        return int(self._skips.sum().item())

    def reset(self) -> int:
        """Zero the count; returns what it was."""
        skipped = self.skipped
        self._skips.zero_()
        return skipped

    def read(self, position: int, *, min_short_side: int = 0) -> tuple[int, Image.Image]:
        """(position read, its RGB image): `position` itself, or the next readable one when it is unreadable.
        `min_short_side` > 0: JPEGs decoded at a reduced scale when they are at least twice that (`read_image`).

        Raises:
            DataError: `MAX_CONSECUTIVE_UNREADABLE` unreadable images in a row, or no readable image at all.
        """
        return self._read(position, functools.partial(read_image, min_short_side=min_short_side))

    def read_pixels(self, position: int) -> tuple[int, torch.Tensor]:
        """As `read`, the image as uint8 (3, H, W) in channels-last memory (`read_image_pixels`)."""
        return self._read(position, read_image_pixels)

    def _read(self, position: int, reader: Callable[[Path], T]) -> tuple[int, T]:
        files = self.index.files
        tries = min(MAX_CONSECUTIVE_UNREADABLE, len(files))
        last: UnreadableImage | None = None
        for offset in range(tries):
            at = (position + offset) % len(files)
            try:
                return at, reader(self.index.root / files[at][0])
            except UnreadableImage as err:
                self._count(at, err)
                last = err
        if tries == len(files):
            raise DataError(
                f"none of the {len(files)} images in {self.index.root} is readable (the last one tried: {last}); "
                "check the dataset copy"
            )
        raise DataError(
            f"{tries} unreadable images in a row in {self.index.root} from {files[position][0]} (the last one tried: "
            f"{last}); check the dataset copy (truncated download?)"
        )

    def _count(self, position: int, err: UnreadableImage) -> None:
        info = get_worker_info()
        slot = 0 if info is None else 1 + info.id % _MAX_WORKER_SLOTS
        self._skips[slot] += 1
        rel = self.index.files[position][0]
        if rel not in self._warned:
            self._warned.add(rel)
            log.warning("skipping unreadable image (%d skipped so far): %s", self.skipped, err)


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
        limit: N > 0 keeps N images evenly spaced over the class-sorted listing (`evenly_spaced`: every class
            stays represented); 0 keeps all.
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
        limit: int = 0,
    ) -> None:
        self.index = index if index is not None else scan_image_folder(root)
        self.positions = evenly_spaced(len(self.index.files), limit)
        self.root = self.index.root
        self.classes = self.index.classes
        self.image_size = image_size
        self.crop: CropMode = "random" if train else "center"
        self.flip: FlipMode = flip if flip is not None else ("random" if train and horizontal_flip else "none")
        self.seed = seed
        self._epoch = EpochCounter()
        self._reader = UnreadableSkipper(self.index)

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
        return self._reader.skipped

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch of the augmentation draws; logs and resets the previous epoch's skip count."""
        skipped = self._reader.reset()
        if skipped:
            log.warning(
                "%s: epoch %d replaced %d unreadable image(s) by the next readable one", self.root, self.epoch, skipped
            )
        self._epoch.set(epoch)

    def __len__(self) -> int:
        return len(self.positions)

    def _position(self, index: int) -> int:
        """The listing position of sample `index`."""
        return self.positions[index]

    def _read(self, position: int) -> tuple[int, Any]:
        """(position read, its image as `_transform` takes it): a PIL image here (VAR's LANCZOS resize), decoded at a
        reduced DCT scale when its shorter side is at least twice the resize target (`read_image`)."""
        return self._reader.read(position, min_short_side=round(RESIZE_RATIO * self.image_size))

    def _transform(self, img: Any, index: int) -> torch.Tensor:
        """Resize, crop and flip one decoded image (sample `index`'s draws for the current epoch)."""
        draws = (
            augment_draws(self.seed, self.epoch, index) if (self.crop == "random" or self.flip == "random") else (0, 0)
        )
        return var_resize_crop(img, self.image_size, crop=self.crop, flip=self.flip, draws=draws)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        position, img = self._read(self._position(index))
        label = torch.tensor(self.index.files[position][1], dtype=torch.int64)
        return {"image": self._transform(img, index), "label": label}

    def describe(self) -> dict[str, Any]:
        """What identifies this dataset's content (for token-cache fingerprints)."""
        limited = {"limit": len(self)} if len(self) < len(self.index.files) else {}
        return {
            "kind": "image-folder",
            "size": len(self),
            "num_classes": self.num_classes,
            "listing_sha256": self.index.listing_sha256(),
            "image_size": self.image_size,
            "crop": self.crop,
            "flip": self.flip,
            "jpeg_decode": "reduced-dct",  # large JPEGs decoded at 1/2, 1/4 or 1/8 scale (`_read`)
            "resize": "crop-box",  # only the crop is resampled (`pixel_ops.lanczos_resize_crop`)
            **limited,
        }
