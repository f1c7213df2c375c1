"""A set of images to evaluate, read from a folder of image files or from an `.npz`, one image at a time.

Two layouts are read, both written by `trainlab sample --out-dir DIR`:

- a folder of `.png` / `.jpg` / `.jpeg` files (not its sub-folders), taken in sorted name order. A name ending in
  `_cCCCC` (`000042_c0007.png`) carries the image's class label; the set has labels only when every name does.
- an `.npz` holding uint8 (N, H, W, 3) images under `arr_0` (the layout of OpenAI's guided-diffusion evaluator, which
  VAR's published FIDs use). An int array (N,) under `arr_1` (the evaluator's "labeled" reference batches) gives the
  labels. An uncompressed `arr_0` (`np.savez`, and what `trainlab sample` writes) is memory-mapped, so a 50,000-image
  file is never read into memory at once; a compressed one is loaded whole.

Every image must have the same size (FID and the judge compare like with like); greyscale and RGBA files are
converted to RGB. `fingerprint()` hashes the content, so cached statistics are reused only for the same images.

Image files are read by `trainlab.data.images` (regular files only, never blocking on a FIFO, plain raster formats,
a pixel limit checked from the header against decompression bombs); an unreadable one stops with one line naming it.
`.npz` members are read by `read_npz_member`: never unpickled (object arrays are refused), the header checked against
the member's size before anything is mapped or allocated, and any malformed file (bad magic, truncated, not a zip)
one line naming the file.
"""

# Shape legend: N images, H/W pixels, 3 RGB channels.

from __future__ import annotations

import dataclasses
import hashlib
import math
import re
import struct
import zipfile
from pathlib import Path
from typing import IO

import numpy as np

from trainlab.data.images import UnreadableImage, read_image, read_image_size
from trainlab.errors import UsageError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
_LABEL_PATTERN = re.compile(r"_c(\d+)$")
_MAX_LABEL = 2**31 - 1  # a class number in a file name beyond this is no class of any model
_ZIP_LOCAL_HEADER = struct.Struct("<4s5H3I2H")  # signature ... file-name length, extra-field length (30 bytes)


@dataclasses.dataclass(frozen=True)
class ImageSet:
    """N images of one size, each read as uint8 (H, W, 3); class labels when the source has them.

    Attributes:
        source: the folder or `.npz` the images come from.
        files: the image files of a folder, in order (empty for an `.npz`).
        array_NHW3: the images of an `.npz` (memory-mapped when possible; None for a folder).
        image_shape: (H, W, 3), the same for every image.
        labels_N: int64 class labels, or None.
    """

    source: Path
    files: tuple[Path, ...]
    array_NHW3: np.ndarray | None
    image_shape: tuple[int, int, int]
    labels_N: np.ndarray | None

    def __len__(self) -> int:
        return len(self.files) if self.array_NHW3 is None else int(self.array_NHW3.shape[0])

    def image(self, index: int) -> np.ndarray:
        """Image `index` as a C-contiguous uint8 (H, W, 3) array."""
        if self.array_NHW3 is not None:
            return np.array(self.array_NHW3[index])  # a writable copy, not a view of the read-only map
        return _read_rgb(self.files[index])

    def fingerprint(self) -> str:
        """SHA-256 of the images' bytes (file order and content), the key of cached statistics."""
        digest = hashlib.sha256()
        if self.array_NHW3 is not None:
            digest.update(repr(self.array_NHW3.shape).encode())
            for start in range(0, len(self), 256):
                digest.update(np.ascontiguousarray(self.array_NHW3[start : start + 256]).tobytes())
        else:
            for path in self.files:
                digest.update(path.name.encode() + b"\0")
                digest.update(path.read_bytes())
        return digest.hexdigest()

    def describe(self) -> str:
        return f"{self.source} ({len(self)} images of {self.image_shape[1]}x{self.image_shape[0]})"


def read_image_set(path: Path, *, flag: str = "--samples") -> ImageSet:
    """Open a folder of images or an evaluator-layout `.npz` (see the module docstring).

    Args:
        path: the folder or `.npz` file.
        flag: the command-line flag that named `path`, for error messages.

    Raises:
        UsageError: missing path, an empty folder, an `.npz` without uint8 (N, H, W, 3) images under `arr_0`,
            labels of the wrong shape, an unreadable image, or images of different sizes.
    """
    if path.is_dir():
        return _read_folder(path, flag)
    if path.is_file() and path.suffix == ".npz":
        return _read_npz(path, flag)
    if path.exists():
        raise UsageError(f"{flag} {path}: pass a folder of PNG/JPEG images or an .npz with images under arr_0")
    raise UsageError(f"{flag} {path} not found: pass a folder of images (trainlab sample --out-dir) or an .npz")


def _read_rgb(path: Path) -> np.ndarray:
    try:
        return np.array(read_image(path), dtype=np.uint8)  # a writable copy (PIL arrays are read-only)
    except UnreadableImage as err:
        raise UnreadableImage(f"{err}; delete or replace it") from None


def _read_size(path: Path) -> tuple[int, int]:
    try:
        return read_image_size(path)
    except UnreadableImage as err:
        raise UnreadableImage(f"{err}; delete or replace it") from None


def _read_folder(folder: Path, flag: str) -> ImageSet:
    files = tuple(sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES))
    if not files:
        raise UsageError(f"{flag} {folder} holds no .png/.jpg images (sub-folders are not searched)")
    sizes: dict[tuple[int, int], Path] = {}
    for path in files:  # headers only: a mixed folder fails before any feature is extracted
        sizes.setdefault(_read_size(path), path)
        if len(sizes) > 1:
            (w1, h1), (w2, h2) = list(sizes)
            first, other = sizes[(w1, h1)], sizes[(w2, h2)]
            raise UsageError(
                f"{flag} {folder} mixes image sizes ({first.name} is {w1}x{h1}, {other.name} is {w2}x{h2}): "
                "evaluate one size at a time"
            )
    ((width, height),) = sizes
    matches = [_LABEL_PATTERN.search(p.stem) for p in files]
    labels_N = None
    if all(matches):
        labels = [int(m.group(1)) for m in matches if m]
        if max(labels) > _MAX_LABEL:
            name = files[labels.index(max(labels))].name
            raise UsageError(f"{flag} {folder}: {name} names class {max(labels)}, which no model has; rename the file")
        labels_N = np.array(labels, dtype=np.int64)
    elif any(matches):  # some named with a label, some not: a stray file, which unlabelled evaluation would count
        stray = files[[m is None for m in matches].index(True)].name
        raise UsageError(
            f"{flag} {folder}: {stray} has no class label in its name where the other images have one "
            "(NNNNNN_cCCCC.png); remove it or name it so"
        )
    return ImageSet(folder, files, None, (height, width, 3), labels_N)


def _read_npz(path: Path, flag: str) -> ImageSet:
    names = npz_members(path, flag)
    if "arr_0" not in names:
        raise UsageError(
            f"{flag} {path} has no arr_0 (arrays: {', '.join(sorted(names)) or 'none'}): pass an .npz with uint8 "
            "(N, H, W, 3) images under arr_0 (np.savez(path, images), or trainlab sample --out-dir)"
        )
    array_NHW3 = read_npz_member(path, "arr_0", flag)
    if array_NHW3.dtype != np.uint8 or array_NHW3.ndim != 4 or array_NHW3.shape[-1] != 3:
        raise UsageError(
            f"{flag} {path}: arr_0 is {array_NHW3.dtype} {array_NHW3.shape}, expected uint8 (N, H, W, 3) images"
        )
    if array_NHW3.shape[0] == 0:
        raise UsageError(f"{flag} {path}: arr_0 holds no images")
    if 0 in array_NHW3.shape[1:3]:
        raise UsageError(f"{flag} {path}: arr_0 holds images of {array_NHW3.shape[2]}x{array_NHW3.shape[1]} pixels")
    labels_N = None
    if "arr_1" in names:
        labels_N = np.asarray(read_npz_member(path, "arr_1", flag))
        if labels_N.shape != (array_NHW3.shape[0],) or not np.issubdtype(labels_N.dtype, np.integer):
            raise UsageError(
                f"{flag} {path}: arr_1 is {labels_N.dtype} {labels_N.shape}, expected int class labels "
                f"({array_NHW3.shape[0]},)"
            )
        if labels_N.size and int(labels_N.max()) > _MAX_LABEL:  # before the cast, which would wrap 2**64-1 to -1
            raise UsageError(f"{flag} {path}: arr_1 holds the label {int(labels_N.max())}, which no model has")
        labels_N = labels_N.astype(np.int64)
    return ImageSet(path, (), array_NHW3, tuple(array_NHW3.shape[1:]), labels_N)


def npz_members(path: Path, flag: str) -> set[str]:
    """Names of the arrays in an `.npz` (its `.npy` members without the suffix).

    Raises:
        UsageError: the file is not a readable zip archive.
    """
    try:
        with zipfile.ZipFile(path) as archive:
            return {name[: -len(".npy")] for name in archive.namelist() if name.endswith(".npy")}
    except (OSError, zipfile.BadZipFile, EOFError, ValueError) as err:
        raise UsageError(f"{flag} {path} is not a readable .npz ({_one_line(err)}); pass a file of np.savez") from None


def read_npz_member(path: Path, name: str, flag: str) -> np.ndarray:
    """Array `name` of an `.npz`, memory-mapped when stored uncompressed in C order, else loaded; never unpickled.

    The `.npy` header is read first: an object array (pickled Python objects) is refused, and a shape that does not
    match the member's size (a truncated or doctored file) is refused before anything is mapped or allocated.

    Raises:
        UsageError: one line naming the file, for an object array, a size mismatch or any malformed member.
    """
    try:
        with zipfile.ZipFile(path) as archive:
            info = archive.getinfo(f"{name}.npy")
            with archive.open(info) as member:
                header = _npy_header(member)
                header_size = member.tell()
            if header is not None:
                shape, fortran_order, dtype = header
                if dtype.hasobject:
                    raise UsageError(
                        f"{flag} {path}: {name} is an object array (pickled Python objects), which is never loaded; "
                        "save plain numeric arrays (np.savez with numpy arrays of numbers)"
                    )
                size = math.prod(shape) * dtype.itemsize
                if size != info.file_size - header_size:
                    raise UsageError(
                        f"{flag} {path}: {name} declares {shape} {dtype} ({size} bytes) but holds "
                        f"{info.file_size - header_size} bytes: the file is truncated or damaged"
                    )
                if info.compress_type == zipfile.ZIP_STORED and not fortran_order and size > 0:
                    return np.memmap(
                        path, dtype=dtype, mode="r", offset=_data_offset(path, info) + header_size, shape=shape
                    )
            with archive.open(info) as member:
                return np.lib.format.read_array(member, allow_pickle=False)
    except UsageError:
        raise
    except Exception as err:  # nothing here runs code; any failure is a malformed file (bad magic, EOF, bad zip...)
        raise UsageError(f"{flag} {path}: {name} is not a readable .npy member ({_one_line(err)})") from None


def _npy_header(member: IO[bytes]) -> tuple[tuple[int, ...], bool, np.dtype] | None:
    """(shape, fortran order, dtype) of an .npy stream of format 1.0 / 2.0; None for another version."""
    version = np.lib.format.read_magic(member)
    if version == (1, 0):
        return np.lib.format.read_array_header_1_0(member)
    if version == (2, 0):
        return np.lib.format.read_array_header_2_0(member)
    return None


def _data_offset(path: Path, info: zipfile.ZipInfo) -> int:
    """Where a stored (uncompressed) member's bytes start in the archive: after its local header."""
    with open(path, "rb") as raw:
        raw.seek(info.header_offset)
        fields = _ZIP_LOCAL_HEADER.unpack(raw.read(_ZIP_LOCAL_HEADER.size))
    return info.header_offset + _ZIP_LOCAL_HEADER.size + fields[-2] + fields[-1]


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())[:200]
    return f"{type(err).__name__}: {text}" if text else type(err).__name__
