"""`read_image_pixels`: the image reader's pixels as a uint8 tensor, the same checks as `read_image` (regular files
only, the format list, the pixel limit from the header, truncated or corrupt streams refused)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from trainlab.data import images
from trainlab.data.images import UnreadableImage, read_image, read_image_pixels
from trainlab.data.transforms import var_resize_crop


def _photo(path: Path, width: int = 61, height: int = 47, **save: object) -> Path:
    y, x = np.mgrid[0:height, 0:width]
    pixels_HW3 = np.stack([x * 4 % 256, y * 5 % 256, (x + y) * 3 % 256], -1).astype(np.uint8)
    Image.fromarray(pixels_HW3).save(path, **save)  # type: ignore[arg-type]
    return path


@pytest.mark.parametrize(
    ("name", "save"),
    [("a.jpg", {"quality": 90}), ("p.jpg", {"quality": 80, "progressive": True}), ("a.png", {}), ("a.webp", {})],
)
def test_the_pixels_are_read_images_in_channels_last_memory(tmp_path: Path, name: str, save: dict[str, object]) -> None:
    path = _photo(tmp_path / name, **save)
    pixels_3HW = read_image_pixels(path)
    assert pixels_3HW.dtype == torch.uint8 and pixels_3HW.shape == (3, 47, 61) and pixels_3HW.stride()[0] == 1
    assert torch.equal(pixels_3HW, torch.from_numpy(np.array(read_image(path))).permute(2, 0, 1))


def test_a_grey_jpeg_gives_three_equal_channels_as_read_image(tmp_path: Path) -> None:
    path = tmp_path / "g.jpg"
    Image.fromarray(np.arange(47 * 61, dtype=np.uint8).reshape(47, 61)).save(path)
    assert torch.equal(read_image_pixels(path), torch.from_numpy(np.array(read_image(path))).permute(2, 0, 1))


def test_a_truncated_jpeg_is_unreadable(tmp_path: Path) -> None:
    path = _photo(tmp_path / "t.jpg", 200, 150, quality=90)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(UnreadableImage, match=r"t\.jpg"):
        read_image_pixels(path)


def test_the_pixel_limit_is_checked_from_the_header(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _photo(tmp_path / "big.jpg", quality=90)
    monkeypatch.setattr(images, "MAX_IMAGE_PIXELS", 47 * 61 - 1)
    with pytest.raises(UnreadableImage, match="decompression bomb"):
        read_image_pixels(path)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_fifo_named_jpg_is_refused_at_once(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "f.jpg")
    with pytest.raises(UnreadableImage, match="not a regular file"):
        read_image_pixels(tmp_path / "f.jpg")


def _noisy_photo(path: Path, width: int, height: int) -> Path:
    """Smooth colour fields plus pixel noise (sigma 12 levels), JPEG quality 90: harder than a photograph."""
    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    f = rng.uniform(10, 60, size=(3, 2))
    base = np.stack([128 + 100 * np.sin(x / f[c, 0] + c) * np.cos(y / f[c, 1] - c) for c in range(3)], -1)
    pixels_HW3 = np.clip(base + rng.normal(0, 12, (height, width, 3)), 0, 255).astype(np.uint8)
    Image.fromarray(pixels_HW3).save(path, quality=90)
    return path


@pytest.mark.parametrize(("width", "height", "reduced"), [(1200, 900, (600, 450)), (900, 1200, (450, 600))])
def test_a_reduced_scale_decode_is_within_resampling_error_of_the_full_decode(
    tmp_path: Path, width: int, height: int, reduced: tuple[int, int]
) -> None:
    """VAR's 256 px crop (shorter side to 288, LANCZOS) from a 1/2-scale DCT decode against the same crop from the
    full decode: within 1.5 levels (of 255) on average and 12 at any pixel (measured on these noisy images: 0.9 and
    6; for scale, resizing the full decode with BICUBIC instead of LANCZOS moves the crop by 0.37 on average)."""
    path = _noisy_photo(tmp_path / "big.jpg", width, height)
    full, small = read_image(path), read_image(path, min_short_side=288)
    assert small.size == reduced and read_image(path, min_short_side=451).size == (width, height)
    from_full = var_resize_crop(full, 256, crop="center", flip="none")
    from_small = var_resize_crop(small, 256, crop="center", flip="none")
    error_levels = (from_small - from_full).abs() * 127.5  # [-1, 1] -> 8-bit levels
    assert error_levels.mean() <= 1.5 and error_levels.max() <= 12
