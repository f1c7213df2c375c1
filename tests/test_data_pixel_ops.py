"""The one-core pixel operations (`trainlab.data.pixel_ops`) and the 8-bit crop path against torchvision's.

Tolerances: hue and blur equal torchvision's float32 results within 2e-6 (float rounding; torchvision computes the
hue in float32 whatever the input dtype, trainlab in the input's dtype); a crop resized on 8-bit pixels is within
1.01 levels (1/255) of the same crop resized in float, pixel by pixel, and 0.35 level on average (one rounding to
8 bits, 0.25 level on average, plus the fixed-point weights of torch's uint8 kernel; measured: at most 1.0004,
0.28-0.31 on average).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torchvision.transforms.v2.functional as TF2
from PIL import Image

from trainlab.data.pixel_ops import adjust_hue, gaussian_blur, normalise_uint8, uint8_view
from trainlab.data.transforms import crop_to_unit_float


def _image(seed: int, height: int = 37, width: int = 53) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x_3HW = torch.rand(3, height, width, generator=g)
    x_3HW[:, 0, :5] = 0.5  # grey pixels (no hue)
    x_3HW[1, 1, :5] = x_3HW[0, 1, :5]  # red = green ties
    x_3HW[2, 2, :5] = x_3HW[1, 2, :5]  # green = blue ties
    return x_3HW


@pytest.mark.parametrize("hue", [-0.5, -0.1, -0.03, 0.0, 0.07, 0.1, 0.5])
def test_hue_is_torchvisions_within_float_rounding(hue: float) -> None:
    x_3HW = _image(0)
    assert (adjust_hue(x_3HW, hue) - TF2.adjust_hue(x_3HW, hue)).abs().max() < 2e-6


@pytest.mark.parametrize(("sigma", "side"), [(0.1, 32), (0.7, 32), (2.0, 32), (2.0, 9)])
def test_blur_is_torchvisions_within_float_rounding(sigma: float, side: int) -> None:
    x_3HW = _image(1, side, side)
    kernel = min(2 * math.ceil(3 * sigma) + 1, side - (1 - side % 2))
    expected = TF2.gaussian_blur(x_3HW, [kernel, kernel], [sigma, sigma])
    assert (gaussian_blur(x_3HW, kernel, sigma) - expected).abs().max() < 2e-6


def test_uint8_view_is_the_image_in_channels_last_memory() -> None:
    pixels_HW3 = np.random.default_rng(0).integers(0, 256, (21, 34, 3), dtype=np.uint8)
    view_3HW = uint8_view(Image.fromarray(pixels_HW3))
    assert view_3HW.dtype == torch.uint8 and view_3HW.shape == (3, 21, 34) and view_3HW.stride() == (1, 102, 3)
    assert torch.equal(view_3HW, torch.from_numpy(pixels_HW3).permute(2, 0, 1))


@pytest.mark.parametrize("box", [(0, 0, 375, 500), (40, 17, 120, 90), (100, 200, 30, 250), (300, 10, 75, 400)])
def test_an_8_bit_crop_is_within_one_level_of_the_float_crop(box: tuple[int, int, int, int]) -> None:
    pixels_HW3 = np.random.default_rng(2).integers(0, 256, (375, 500, 3), dtype=np.uint8)
    img_3HW = uint8_view(Image.fromarray(pixels_HW3))
    from_8_bit = crop_to_unit_float(img_3HW, *box, 224)
    from_float = crop_to_unit_float(img_3HW.float().div(255), *box, 224)
    diff = (from_8_bit - from_float).abs()
    assert from_8_bit.dtype == torch.float32 and from_8_bit.shape == (3, 224, 224)
    assert diff.max() <= 1.01 / 255 and diff.mean() < 0.35 / 255


def test_uint8_normalisation_is_the_three_steps_within_float_rounding() -> None:
    pixels_3HW = torch.randint(0, 256, (3, 20, 30), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    expected = TF2.normalize(pixels_3HW.float().div(255), list(mean), list(std))
    got = normalise_uint8(pixels_3HW.permute(1, 2, 0).contiguous().permute(2, 0, 1), mean, std)
    assert got.dtype == torch.float32 and (got - expected).abs().max() < 2e-6
