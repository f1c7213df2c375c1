"""The one image reader: every recipe, data module and command that opens an image file goes through `read_image`.

The same rules everywhere:
- Only regular files are opened. The file is opened with `O_NONBLOCK` and checked with `fstat` on the open
  descriptor, so a FIFO, socket or device named `*.png` is refused at once instead of blocking (a FIFO without a
  writer blocks a plain `open` forever), and a file swapped between a check and the open cannot slip through.
- Only plain raster formats are decoded (`IMAGE_FORMATS`). Pillow identifies a file by its content, not its name:
  without the restriction an EPS file named `.png` would be handed to Ghostscript.
- Decompression bombs are refused from the header, before any pixel is decoded: an image of more than
  `MAX_IMAGE_PIXELS` pixels (Pillow's own default limit, 89,478,485, about 9459 x 9459) is an error, where Pillow
  alone only warns up to twice that.
- Everything that goes wrong (missing, not a regular file, not an image, a format outside the list, truncated,
  corrupt, too large) is one typed error, `UnreadableImage`, whose message names the file and the reason (callers
  add the fix that fits them). Training datasets catch it and skip the image (`trainlab.data.image_folder`);
  commands that read an image the user named stop with it as one line (exit code 2).

Decoding is Pillow's, unchanged: `read_image(path)` returns exactly what `Image.open(path).convert("RGB")` gives for
a valid image, except for grey images of more than 8 bits, which Pillow's `convert` clips to 255 (a 16-bit PNG comes
out white, a float TIFF in [0, 1] black): they are scaled to 8 bits (`_wide_grey_to_8bit`: 16-bit values / 257,
float values in [0, 1] x 255), and one whose values fit no such range is unreadable. `read_image_pixels(path)` gives
the same pixels as a uint8 (3, H, W) tensor in channels-last memory (what the 8-bit crops resize fastest): after the
same checks, a baseline RGB JPEG is decoded by torchvision's libjpeg-turbo decoder (`torchvision.io.decode_jpeg`,
straight into a tensor: no PIL image, no copy through numpy; a truncated or corrupt stream is an error there too),
every other image by Pillow as `read_image` does.
"""

from __future__ import annotations

import contextlib
import math
import os
import stat
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import numpy as np
from PIL import Image

from trainlab.data.errors import DataError

if TYPE_CHECKING:
    import torch

MAX_IMAGE_PIXELS = 89_478_485  # Pillow's Image.MAX_IMAGE_PIXELS default: 1024 * 1024 * 1024 // 4 // 3
# Plain raster formats, by Pillow's format name. JPEG also admits MPO (multi-picture JPEG from cameras); PPM covers
# .pgm / .pbm. Not here: EPS (runs Ghostscript), PDF, vector and container formats.
IMAGE_FORMATS = ("PNG", "JPEG", "BMP", "PPM", "TIFF", "WEBP", "GIF")
_WIDE_GREY_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I", "F")  # Pillow's grey modes of more than 8 bits
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)


class UnreadableImage(DataError):
    """An image file that cannot be read: missing, not a regular file, not an image, truncated, corrupt or too large.

    The message is one line naming the file and the reason.
    """


def read_image(path: str | Path, mode: str = "RGB", *, min_short_side: int = 0) -> Image.Image:
    """Decode one image file under the rules of the module docstring.

    Args:
        path: the image file.
        mode: the Pillow mode of the result ("RGB", or "L" for an 8-bit grey mask).
        min_short_side: > 0 when the caller resizes the shorter side down to this many pixels anyway: a JPEG whose
            shorter side is at least twice that is decoded at a reduced DCT scale (1/2, 1/4 or 1/8: Pillow's
            `draft`, the largest reduction that keeps the shorter side >= `min_short_side`), so it comes back
            smaller than the file. 0: full size.

    Returns:
        The decoded image in `mode`, independent of the file (which is closed).

    Raises:
        UnreadableImage: the file is missing, not a regular file, not an image of `IMAGE_FORMATS`, larger than
            `MAX_IMAGE_PIXELS`, truncated or corrupt.
    """
    with _open_image(path) as img:
        width, height = img.size
        if img.format == "JPEG" and 0 < 2 * min_short_side <= min(width, height):
            scale = min_short_side / min(width, height)
            img.draft(mode, (math.ceil(width * scale), math.ceil(height * scale)))
        return _decoded(path, img, mode)


def read_image_pixels(path: str | Path) -> torch.Tensor:
    """The RGB pixels of an image file as uint8 (3, H, W) with channels-last strides, under the module's rules.

    The pixels equal `read_image(path)`'s; RGB JPEGs are decoded by `torchvision.io.decode_jpeg`.

    Raises:
        UnreadableImage: as `read_image`.
    """
    import torch
    from torchvision.io import ImageReadMode, decode_jpeg

    from trainlab.data.pixel_ops import uint8_view

    with _open_image_file(path) as (img, f):
        if img.format != "JPEG" or img.mode != "RGB":
            return uint8_view(_decoded(path, img, "RGB"))
        f.seek(0)
        data = bytearray(f.read())
    try:
        pixels_3HW = decode_jpeg(torch.frombuffer(data, dtype=torch.uint8), mode=ImageReadMode.RGB)
    except RuntimeError as err:
        raise _unreadable(path, _reason(err)) from None
    return pixels_3HW.permute(1, 2, 0).contiguous().permute(2, 0, 1)


def read_image_size(path: str | Path) -> tuple[int, int]:
    """(width, height) of an image file from its header, without decoding pixels; the same checks as `read_image`.

    Raises:
        UnreadableImage: as `read_image`, except that a truncated pixel stream is only found when decoding.
    """
    with _open_image(path) as img:
        return img.size


@contextlib.contextmanager
def _open_image(path: str | Path) -> Iterator[Image.Image]:
    """`Image.open` of a regular file, restricted to `IMAGE_FORMATS`, with the pixel limit checked from the header."""
    with _open_image_file(path) as (img, _):
        yield img


@contextlib.contextmanager
def _open_image_file(path: str | Path) -> Iterator[tuple[Image.Image, BinaryIO]]:
    """`_open_image`, and the open file it reads (the same descriptor the checks were made on)."""
    with _open_regular(path) as f:
        try:
            with warnings.catch_warnings():  # the limit is checked below, as an error, for every size over it
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                img = Image.open(f, formats=IMAGE_FORMATS)
        except Image.DecompressionBombError:
            raise _unreadable(path, f"over the limit of {MAX_IMAGE_PIXELS} pixels (a decompression bomb?)") from None
        except Exception as err:
            raise _unreadable(path, _reason(err)) from None
        with img:
            width, height = img.size
            if width * height > MAX_IMAGE_PIXELS:
                raise _unreadable(
                    path,
                    f"{width}x{height} = {width * height} pixels, over the limit of {MAX_IMAGE_PIXELS} pixels "
                    "(a decompression bomb?)",
                )
            yield img, f


def _decoded(path: str | Path, img: Image.Image, mode: str) -> Image.Image:
    """Every pixel of `img` decoded into `mode` (a truncated or corrupt file fails here), wide grey scaled to 8 bits."""
    try:
        if img.mode in _WIDE_GREY_MODES:
            return _wide_grey_to_8bit(path, img).convert(mode)
        return img.convert(mode)
    except UnreadableImage:
        raise
    except Exception as err:  # Pillow's decoders raise OSError, ValueError, SyntaxError, struct.error, ...
        raise _unreadable(path, _reason(err)) from None


def _wide_grey_to_8bit(path: str | Path, img: Image.Image) -> Image.Image:
    """A grey image of 16-bit, 32-bit or float pixels as 8-bit grey ("L"), scaled instead of clipped.

    16-bit modes ("I;16*") are divided by 257 (65535 -> 255). "I" (32-bit int) holds 8-bit values unchanged and
    16-bit ones divided by 257. "F" (float) in [0, 1] is multiplied by 255; in [0, 255] kept.

    Raises:
        UnreadableImage: values outside every such range (negative, non-finite, beyond 16 bits or 255.0).
    """
    grey_HW = np.asarray(img, dtype=np.float64)  # decodes every pixel
    if grey_HW.size == 0:
        return Image.new("L", img.size)
    low, high = float(grey_HW.min()), float(grey_HW.max())
    if not (math.isfinite(low) and math.isfinite(high)) or low < 0:
        raise _unreadable(path, f"{img.mode} grey pixels in [{low:g}, {high:g}]: not an 8-bit, 16-bit or [0, 1] image")
    if img.mode == "F":
        scale = 255.0 if high <= 1.0 else 1.0 if high <= 255.0 else 0.0
    else:
        scale = 1 / 257 if img.mode.startswith("I;16") or high > 255 else 1.0
        scale = scale if high <= 65535 else 0.0
    if not scale:
        raise _unreadable(path, f"{img.mode} grey pixels in [{low:g}, {high:g}]: not an 8-bit, 16-bit or [0, 1] image")
    return Image.fromarray(np.rint(grey_HW * scale).astype(np.uint8), "L")


def _open_regular(path: str | Path) -> BinaryIO:
    """The file opened for reading without blocking, refused unless it is a regular file (checked on the open fd)."""
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError as err:
        raise _unreadable(path, err.strerror or type(err).__name__) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise _unreadable(path, f"not a regular file ({_file_kind(info.st_mode)})")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _unreadable(path: str | Path, reason: str) -> UnreadableImage:
    return UnreadableImage(f"{path} is not a readable image: {reason}")


def _reason(err: BaseException) -> str:
    if isinstance(err, Image.UnidentifiedImageError):
        return f"not an image of a supported format: {', '.join(IMAGE_FORMATS)}"
    text = " ".join(str(err).split())[:160]
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def _file_kind(mode: int) -> str:
    for check, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if check(mode):
            return name
    return "a special file"
