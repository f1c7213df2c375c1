"""Peak signal-to-noise ratio for reconstructions of images in [-1, 1].

    PSNR = 10 log10(data_range^2 / MSE), computed per image over (C, H, W) and then averaged over the batch

(the mean of per-image PSNRs, not the PSNR of the batch MSE, so one bad image cannot hide behind many good ones).
"""

# Legend: B images, C channels, H/W pixels.

from __future__ import annotations

import math

import torch

from trainlab.errors import UsageError

MIN_MSE = 1e-10  # caps the PSNR of an exact copy (10 log10(4 / 1e-10) = 106 dB at data_range 2) instead of inf


def psnr(a_BCHW: torch.Tensor, b_BCHW: torch.Tensor, data_range: float = 2.0) -> float:
    """Mean over the batch of the per-image PSNR in dB.

    Args:
        a_BCHW: images, e.g. reconstructions, (B, C, H, W).
        b_BCHW: reference images of the same shape.
        data_range: max minus min of the pixel range (2.0 for [-1, 1]; 1.0 for [0, 1]; 255 for uint8).

    Returns:
        The mean PSNR in dB. An exact copy scores 10 log10(data_range^2 / 1e-10) rather than infinity.

    Raises:
        UsageError: the shapes differ or are not (B, C, H, W), or data_range is not positive.
    """
    if a_BCHW.shape != b_BCHW.shape or a_BCHW.ndim != 4:
        raise UsageError(f"PSNR needs two (B, C, H, W) batches of one shape, got {a_BCHW.shape} and {b_BCHW.shape}")
    if data_range <= 0:
        raise UsageError(f"PSNR data_range must be positive, got {data_range}")
    diff_BCHW = a_BCHW.detach().double() - b_BCHW.detach().to(a_BCHW.device).double()
    mse_B = diff_BCHW.square().flatten(1).mean(dim=1).clamp_min(MIN_MSE)
    psnr_B = 10.0 * torch.log10(data_range**2 / mse_B)
    return psnr_B.mean().item()


def psnr_from_mse(mse: float, data_range: float = 2.0) -> float:
    """PSNR in dB for one mean squared error (the closed form the tests check `psnr` against)."""
    return 10.0 * math.log10(data_range**2 / max(mse, MIN_MSE))
