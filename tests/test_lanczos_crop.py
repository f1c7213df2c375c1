"""VAR's resize + crop with only the crop resampled (`pixel_ops.lanczos_resize_crop`) against the official order
(torchvision `Resize(288, LANCZOS)` of the whole image, then the crop): within 1 level, on a tiny share of pixels."""

from __future__ import annotations

import numpy as np
import pytest
import torchvision.transforms.functional as TF
from PIL import Image
from torchvision.transforms import InterpolationMode

from trainlab.data.augment import augment_draws, mixed_radix_digits
from trainlab.data.pixel_ops import lanczos_resize_crop, resized_size
from trainlab.data.transforms import var_resize_crop

SIZES = [(500, 375), (375, 500), (500, 333), (333, 500), (640, 480), (1024, 768), (289, 288), (288, 400), (900, 300)]


def _image(width: int, height: int, seed: int) -> Image.Image:
    """A ramp plus strong noise: LANCZOS overshoots and clips, so a pass order or a shifted tap shows."""
    rng = np.random.default_rng(seed)
    ramp = np.linspace(0, 255, width)[None, :, None]
    return Image.fromarray(np.clip(ramp + rng.normal(0, 60, size=(height, width, 3)), 0, 255).astype(np.uint8))


@pytest.mark.parametrize(("width", "height"), SIZES)
def test_resampling_the_crop_only_equals_resizing_then_cropping(width: int, height: int) -> None:
    img = _image(width, height, seed=width + height)
    full = TF.resize(img, 288, interpolation=InterpolationMode.LANCZOS)
    assert full.size == resized_size(width, height, 288)
    rng = np.random.default_rng(0)
    differing = total = 0
    for _ in range(4):
        top, left = int(rng.integers(0, full.height - 256 + 1)), int(rng.integers(0, full.width - 256 + 1))
        expected = np.asarray(full.crop((left, top, left + 256, top + 256)), dtype=np.int16)
        got = np.asarray(lanczos_resize_crop(img, 288, top, left, 256), dtype=np.int16)
        assert np.abs(got - expected).max() <= 1
        differing += int((got != expected).sum())
        total += got.size
    assert differing <= 0.002 * total  # measured: 0.05 % over these sizes


@pytest.mark.parametrize("crop", ["random", "center"])
def test_var_resize_crop_keeps_the_official_crop_positions(crop: str) -> None:
    for width, height in SIZES[:4]:
        img = _image(width, height, seed=1)
        draws = augment_draws(0, 0, width)
        official = TF.resize(img, 288, interpolation=InterpolationMode.LANCZOS)
        if crop == "random":
            top, left = mixed_radix_digits(draws[0], official.height - 256 + 1, official.width - 256 + 1)
            official = TF.crop(official, top, left, 256, 256)
        else:
            official = TF.center_crop(official, [256, 256])
        expected_3HW = TF.to_tensor(official) * 2 - 1
        got_3HW = var_resize_crop(img, 256, crop=crop, flip="none", draws=draws)  # type: ignore[arg-type]
        assert (got_3HW - expected_3HW).abs().max().item() <= 2 / 255 + 1e-6
