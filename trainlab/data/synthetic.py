"""Synthetic image sets that need no files: deterministic, learnable, for tests, `--debug` and benchmarks.

Shapes: N images, K classes, 3/H/W channels and side.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def smooth_noise_images(num_images: int, image_size: int, seed: int) -> torch.Tensor:
    """Smooth random RGB images (N, 3, H, W) in [-1, 1]: low-resolution noise, bilinearly upsampled, tanh."""
    g = torch.Generator().manual_seed(seed)
    low = max(image_size // 4, 1)
    noise_N3hw = torch.randn(num_images, 3, low, low, generator=g)
    return torch.tanh(F.interpolate(noise_N3hw, size=(image_size, image_size), mode="bilinear")).contiguous()


def class_gradient_images(
    num_images: int, image_size: int, num_classes: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Class-dependent horizontal colour gradients plus noise: images (N, 3, H, W) in [-1, 1] and labels (N,).

    The class colours are fixed (they do not depend on `seed`), so splits drawn with different seeds share them.
    """
    g = torch.Generator().manual_seed(seed)
    colors_K32 = torch.rand(num_classes, 3, 2, generator=torch.Generator().manual_seed(1234)) * 2 - 1
    labels_N = torch.arange(num_images) % num_classes
    ramp_W = torch.linspace(0, 1, image_size)
    ramp_HW = ramp_W.view(1, -1).expand(image_size, -1)
    start_N311 = colors_K32[labels_N, :, 0].view(-1, 3, 1, 1)
    end_N311 = colors_K32[labels_N, :, 1].view(-1, 3, 1, 1)
    img_N3HW = start_N311 + (end_N311 - start_N311) * ramp_HW
    img_N3HW = img_N3HW + 0.15 * torch.randn(num_images, 3, image_size, image_size, generator=g)
    return img_N3HW.clamp(-1, 1), labels_N
