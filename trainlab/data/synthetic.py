"""The one synthetic image generator (data kind `fake`): deterministic, learnable images that need no files, for tests,
`--debug` runs, golden losses and benchmarks.

Each of K classes has its own colour and its own stripe orientation; every image adds a random stripe phase, a
brightness jitter and pixel noise, so a small model climbs well above chance (1 / K) within a few epochs:

    pixel = colour_k + 45 sin(2 pi (x cos a_k + y sin a_k) / (S / 4) + phase) + brightness + N(0, 30), rounded to uint8

Orientations a_k = k x 90 / K degrees (0, 9, ..., 81 for 10 classes): a horizontal flip maps a to 180 - a, which no
class uses, so flip augmentation never turns one class's pattern into another's. The colours come from a random
stream that is drawn first, so the training and the held-out split share them.

The training split (`num_train` images) and the held-out split (`num_eval`) are drawn from one NumPy stream of
`seed`: colours, then the training labels and images, then the held-out ones. Labels are balanced and shuffled.
Recipes read the images in memory (`trainlab.data.sources`), or written in CIFAR-10's file format
(`trainlab.data.fake_cifar`: the CIFAR recipe exercises its real reader with them).

Computed in float64: NumPy's float32 sin / cos take CPU-specific SIMD paths, and a last-bit difference moves a pixel
across a rounding boundary; in float64 such a difference is far below what rounds to another byte, so the bytes are
the same on every CPU.

Shape legend: N images, K classes, 3 RGB channels, S (= H = W) image side.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

STRIPE_AMPLITUDE = 45.0
NOISE_STD = 30.0
CHUNK_VALUES = 2**22  # float64 values per chunk of images (32 MiB)


@dataclass(frozen=True, eq=False)
class SyntheticImages:
    """One split: uint8 images (N, 3, S, S) and int64 labels (N,) in [0, K)."""

    images_N3SS: np.ndarray
    labels_N: np.ndarray


def synthetic_splits(
    num_train: int, num_eval: int, *, image_size: int, num_classes: int, seed: int = 0
) -> tuple[SyntheticImages, SyntheticImages]:
    """The training and the held-out split of the synthetic set (module docstring).

    Args:
        num_train: training images.
        num_eval: held-out images (drawn after the training ones, from the same stream).
        image_size: S, the side of the square images (stripes have a period of S / 4 pixels).
        num_classes: K.
        seed: the stream; the same arguments give the same bytes on every machine.

    Returns:
        (training split, held-out split).
    """
    rng = np.random.default_rng(seed)
    palette_K3 = rng.uniform(40, 215, size=(num_classes, 3))
    train = _split(rng, num_train, image_size, palette_K3)
    held_out = _split(rng, num_eval, image_size, palette_K3)
    return train, held_out


def _split(rng: np.random.Generator, num: int, side: int, palette_K3: np.ndarray) -> SyntheticImages:
    num_classes = len(palette_K3)
    labels_N = rng.permutation(np.arange(num) % num_classes).astype(np.int64)
    yy_SS, xx_SS = np.mgrid[0:side, 0:side].astype(np.float64)
    angle_N = labels_N.astype(np.float64) * (math.pi / 2 / num_classes)
    phase_N = rng.uniform(0, 2 * math.pi, size=num)
    brightness_N = rng.uniform(-25, 25, size=num)
    img_N3SS = np.empty((num, 3, side, side), dtype=np.uint8)
    # A few images at a time (float64 temporaries of about CHUNK_VALUES values): the noise of consecutive chunks is
    # drawn from the stream in the same order as one draw of the whole (num, 3, S, S) array, so the bytes do not
    # depend on the chunk size (tests/test_data_sources.py), and the temporaries stay in cache.
    chunk = max(1, CHUNK_VALUES // (3 * side * side))
    for start in range(0, num, chunk):
        part = slice(start, min(start + chunk, num))
        angle_n = angle_N[part]
        coord_nSS = np.cos(angle_n)[:, None, None] * xx_SS[None] + np.sin(angle_n)[:, None, None] * yy_SS[None]
        stripes_nSS = np.sin(2 * math.pi * coord_nSS / (side / 4) + phase_N[part, None, None])
        pixels_n3SS = (
            palette_K3[labels_N[part]][:, :, None, None]
            + STRIPE_AMPLITUDE * stripes_nSS[:, None]
            + brightness_N[part, None, None, None]
            + rng.normal(0, NOISE_STD, size=(len(angle_n), 3, side, side))
        )
        img_N3SS[part] = np.clip(np.rint(pixels_n3SS), 0, 255)
    return SyntheticImages(img_N3SS, labels_N)
