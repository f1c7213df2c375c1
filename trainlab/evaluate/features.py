"""Features of a set of images under a feature map, in batches: the one `extract_features` (kNN banks, the judge's
FID features, linear probes).

Shape legend: N images, B a batch, 3/H/W channels and pixels, F feature width.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from trainlab.dtypes import at_least_float32


@torch.no_grad()
def extract_features(
    features: Callable[[torch.Tensor], torch.Tensor],
    images_N3HW: torch.Tensor,
    *,
    batch_size: int,
    device: torch.device | str,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """`features` of every image, without gradients, in batches moved to `device` and `dtype` (None: the default
    dtype).

    Args:
        features: a feature map, (B, 3, H, W) -> (B, F), e.g. `model.features` (the model in eval mode).
        images_N3HW: the images, on any device.
        batch_size: images per call.
        device: where `features` runs.
        dtype: the input dtype `features` takes.

    Returns:
        (N, F) on `device`, in float32 (float64 for float64 features).
    """
    out = []
    for start in range(0, images_N3HW.shape[0], batch_size):
        x_B3HW = images_N3HW[start : start + batch_size].to(device=device, dtype=dtype or torch.get_default_dtype())
        out.append(at_least_float32(features(x_B3HW)))
    return torch.cat(out)
