"""Fréchet distance between two sets of feature vectors (FID when the features come from a fixed classifier).

Each set is summarised by the mean and covariance of its features, and the distance between the two Gaussians is

    d^2 = ||mu1 - mu2||^2 + Tr(sigma1 + sigma2 - 2 (sigma1 sigma2)^(1/2))

(Heusel et al. 2017, https://arxiv.org/abs/1706.08500). In the demo the features are `DigitJudge.features`, not
Inception's, so the numbers compare runs of this demo only, never published FIDs. FID is biased upwards at small
sample sizes, so compare sets of equal size and report the real-vs-real floor
(`trainlab.data.digits.split_halves`) next to it. All arithmetic is float64.
"""

# Legend: N samples, D feature width.

from __future__ import annotations

import logging

import numpy as np
import scipy.linalg
import torch

from trainlab.errors import UsageError

log = logging.getLogger(__name__)

_IMAGINARY_TOLERANCE = 1e-3


def feature_statistics(features_ND: torch.Tensor | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean (D,) and unbiased covariance (D, D) of N feature vectors, in float64.

    Raises:
        UsageError: not a 2-D array, or fewer than 2 samples.
    """
    x_ND = _as_float64(features_ND)
    if x_ND.ndim != 2 or x_ND.shape[0] < 2:
        raise UsageError(f"FID needs an (N, D) feature array with N >= 2, got shape {x_ND.shape}")
    if x_ND.shape[0] <= x_ND.shape[1]:
        log.warning("FID from %d samples of %d features: the covariance is singular", *x_ND.shape)
    return x_ND.mean(axis=0), np.cov(x_ND, rowvar=False)


def frechet_distance(
    mu1: np.ndarray, sigma1: np.ndarray, mu2: np.ndarray, sigma2: np.ndarray, *, eps: float = 1e-6
) -> float:
    """Fréchet distance between N(mu1, sigma1) and N(mu2, sigma2).

    The matrix square root is `scipy.linalg.sqrtm(sigma1 @ sigma2)`. If it is not finite (singular covariances),
    `eps` is added to both diagonals and it is computed again. A numerically complex result is accepted, and its
    real part kept, only when the imaginary parts of its diagonal are below 1e-3.

    Args:
        mu1: mean (D,) of the first set.
        sigma1: covariance (D, D) of the first set.
        mu2: mean (D,) of the second set.
        sigma2: covariance (D, D) of the second set.
        eps: diagonal offset used only when the plain square root fails.

    Returns:
        The squared Fréchet distance (what FID reports), >= 0 up to rounding.

    Raises:
        UsageError: shapes disagree.
        ValueError: the square root has a significant imaginary part (the covariances are not valid).
    """
    mu1, mu2 = np.atleast_1d(_as_float64(mu1)), np.atleast_1d(_as_float64(mu2))
    sigma1, sigma2 = np.atleast_2d(_as_float64(sigma1)), np.atleast_2d(_as_float64(sigma2))
    dim = mu1.shape[0]
    if mu1.shape != (dim,) or mu2.shape != (dim,) or sigma1.shape != (dim, dim) or sigma2.shape != (dim, dim):
        raise UsageError(
            f"Fréchet distance needs means (D,) and covariances (D, D) of one D: got {mu1.shape}, {sigma1.shape}, "
            f"{mu2.shape}, {sigma2.shape}"
        )
    diff_D = mu1 - mu2
    covmean_DD = scipy.linalg.sqrtm(sigma1 @ sigma2)
    if not np.isfinite(covmean_DD).all():
        log.warning("FID: sqrtm(sigma1 @ sigma2) is not finite; adding %g to the covariance diagonals", eps)
        offset_DD = np.eye(dim) * eps
        covmean_DD = scipy.linalg.sqrtm((sigma1 + offset_DD) @ (sigma2 + offset_DD))
    if np.iscomplexobj(covmean_DD):
        largest_imaginary = float(np.max(np.abs(np.diagonal(covmean_DD).imag)))
        if largest_imaginary > _IMAGINARY_TOLERANCE:
            raise ValueError(f"FID: sqrtm(sigma1 @ sigma2) has imaginary part {largest_imaginary:.3g} on its diagonal")
        covmean_DD = covmean_DD.real
    return float(diff_D @ diff_D + np.trace(sigma1) + np.trace(sigma2) - 2.0 * np.trace(covmean_DD))


def fid_from_features(a_ND: torch.Tensor | np.ndarray, b_MD: torch.Tensor | np.ndarray) -> float:
    """Fréchet distance between the feature distributions of two sets (N and M samples of the same D features)."""
    mu_a, sigma_a = feature_statistics(a_ND)
    mu_b, sigma_b = feature_statistics(b_MD)
    return frechet_distance(mu_a, sigma_a, mu_b, sigma_b)


def _as_float64(x: torch.Tensor | np.ndarray) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    return np.asarray(x, dtype=np.float64)
