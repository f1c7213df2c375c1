"""Pixel operations of the augmentations, written for the speed of one CPU core (a loader worker's share).

    uint8_view          PIL image -> uint8 (3, H, W) tensor over HWC memory (channels-last strides): the layout
                        whose bilinear antialiased resize torch runs with its fast uint8 kernels, so crops are
                        resized on 8-bit pixels before any float conversion
    adjust_hue          HSV hue rotation of float RGB in [0, 1]: torchvision's `adjust_hue` (same formula, the
                        HSV -> RGB step written as one expression per channel); equal to it within float rounding
    gaussian_blur       torchvision's `gaussian_blur` (same kernel, reflect padding) as two separable passes of
                        shifted multiply-adds; equal to it within float rounding
    normalise_uint8     uint8 pixels -> (x / 255 - mean) / std in one multiply-add per pixel (x * 1 / (255 std) -
                        mean / std); equal to the three steps within float rounding
    lanczos_resize_crop torchvision's `Resize(short, LANCZOS)` of a PIL image then a (top, left) square crop, with
                        only the crop resampled: Pillow's two passes (horizontal, then vertical) run separately on
                        the source rows and columns the crop needs (`resize(box=...)`); equal to resizing the whole
                        image then cropping within 1 level on 0.05 % of pixels (the boxes' float32 coordinates), at
                        about 0.6x the time

Shape legend: 3 RGB channels, H/W pixels.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

_HUE_OFFSETS_311 = torch.tensor([5.0, 3.0, 1.0]).view(3, 1, 1)  # R, G, B in HSV -> RGB: k = (n + 6h) mod 6


def uint8_view(img: Image.Image) -> torch.Tensor:
    """An RGB PIL image as a uint8 (3, H, W) tensor with channels-last strides (no copy beyond Pillow's export)."""
    pixels_HW3 = np.array(img, dtype=np.uint8, copy=True)  # writable: torch refuses read-only numpy memory
    return torch.from_numpy(pixels_HW3).permute(2, 0, 1)


def adjust_hue(x_3HW: torch.Tensor, hue: float) -> torch.Tensor:
    """Rotate the hue of float RGB in [0, 1] by `hue` turns (torchvision's `adjust_hue`, `hue` in [-0.5, 0.5])."""
    r, g, b = x_3HW.unbind(0)
    maxc, minc = x_3HW.amax(0), x_3HW.amin(0)
    chroma = maxc - minc
    safe = torch.where(chroma == 0, torch.ones_like(chroma), chroma)
    # hue in sextants [0, 6): torchvision's order of cases (red wins ties, then green)
    h6 = torch.where(maxc == r, (g - b) / safe, torch.where(maxc == g, 2.0 + (b - r) / safe, 4.0 + (r - g) / safe))
    h6 = torch.remainder(h6 + 6.0 * hue, 6.0)
    k_3HW = torch.remainder(_HUE_OFFSETS_311.to(x_3HW.dtype) + h6, 6.0)
    ramp_3HW = torch.minimum(k_3HW, 4.0 - k_3HW).clamp_(0.0, 1.0)
    return maxc - chroma * ramp_3HW


def gaussian_kernel(kernel_size: int, sigma: float, dtype: torch.dtype) -> torch.Tensor:
    """torchvision's 1-D Gaussian kernel: exp(-x^2 / 2 sigma^2) at `kernel_size` points centred on 0, summing to 1."""
    half = (kernel_size - 1) * 0.5
    x = torch.linspace(-half, half, steps=kernel_size, dtype=dtype)
    pdf = torch.exp(-0.5 * (x / sigma).pow(2))
    return pdf / pdf.sum()


def gaussian_blur(x_3HW: torch.Tensor, kernel_size: int, sigma: float) -> torch.Tensor:
    """Gaussian blur with reflect padding (torchvision's `gaussian_blur` with a square kernel, equal sigmas)."""
    kernel = gaussian_kernel(kernel_size, sigma, x_3HW.dtype).tolist()
    pad = kernel_size // 2
    _, h, w = x_3HW.shape
    padded = F.pad(x_3HW[None], (pad, pad, pad, pad), mode="reflect")[0]
    rows = padded[:, :, 0:w] * kernel[0]
    for i in range(1, kernel_size):
        rows.add_(padded[:, :, i : i + w], alpha=kernel[i])
    out_3HW = rows[:, 0:h] * kernel[0]
    for i in range(1, kernel_size):
        out_3HW.add_(rows[:, i : i + h], alpha=kernel[i])
    return out_3HW


def normalise_uint8(x_3HW: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """uint8 pixels scaled to [0, 1] and normalised with `mean` / `std`, in the default dtype, in one pass."""
    dtype = torch.get_default_dtype()
    std_311 = torch.tensor(std, dtype=torch.float64).view(3, 1, 1)
    scale_311 = (1.0 / (255.0 * std_311)).to(dtype)
    offset_311 = (-torch.tensor(mean, dtype=torch.float64).view(3, 1, 1) / std_311).to(dtype)
    return torch.addcmul(offset_311, x_3HW.to(dtype), scale_311)


def resized_size(width: int, height: int, short_side: int) -> tuple[int, int]:
    """(width, height) of torchvision's `Resize(short_side)`: the shorter side to `short_side`, the longer one
    scaled and truncated (an image already that short is left as it is)."""
    if min(width, height) == short_side:
        return width, height
    if width <= height:
        return short_side, int(short_side * height / width)
    return int(short_side * width / height), short_side


def lanczos_resize_crop(img: Image.Image, short_side: int, top: int, left: int, size: int) -> Image.Image:
    """The (top, left, size, size) crop of `img` resized (LANCZOS) to shorter side `short_side`, resampling the crop
    only (see the module docstring); (top, left) are in the resized image's pixels."""
    width, height = img.size
    out_w, out_h = resized_size(width, height, short_side)
    if (out_w, out_h) == (width, height):
        return img.crop((left, top, left + size, top + size))
    scale_x, scale_y = width / out_w, height / out_h
    y0, y1 = top * scale_y, (top + size) * scale_y
    support = 3.0 * max(scale_y, 1.0)  # LANCZOS' half-width, in source rows
    first = max(0, math.floor(y0 - support) - 1)  # every source row the vertical pass reads, none clipped away
    last = min(height, math.ceil(y1 + support) + 1)
    band = img.crop((0, first, width, last)) if (first, last) != (0, height) else img
    rows = band.resize(
        (size, last - first), Image.Resampling.LANCZOS, box=(left * scale_x, 0, (left + size) * scale_x, last - first)
    )  # horizontal pass only: the rows keep their height
    return rows.resize((size, size), Image.Resampling.LANCZOS, box=(0, y0 - first, size, y1 - first))  # vertical
