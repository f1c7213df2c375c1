"""Samples/s per CPU core of trainlab's training data pipelines next to the official ones, side by side in one run.

    .venv/bin/python benchmarks/bench_data.py --label sharedmachine                   # every pipeline, JSON result
    .venv/bin/python benchmarks/bench_data.py --pipelines moco --seconds 2 --json ''  # one pipeline, smoke run
    .venv/bin/python benchmarks/bench_data.py --profile moco                          # where trainlab's time goes

Data (made once in a temporary folder): `--images` synthetic JPEGs (PIL, quality 90) of ImageNet's typical sizes,
mostly 500x375 and 375x500 with some 500x333, 333x500, 640x480 and 1024x768, smooth colour fields plus noise (so
that they compress like photographs, not like flat colour), in two class folders; and `--images` CIFAR-10-shaped
uint8 arrays (N, 32, 32, 3).

Pipelines (official: written from the published transform lists with torchvision's and PIL's public APIs, as
the official code runs them; trainlab: the dataset its recipe builds):
  moco     official main_moco.py: ImageFolder(TwoCropsTransform(augmentation1, augmentation2)) with
           moco/loader.py's PIL GaussianBlur and Solarize, crop-min 0.08; trainlab `FolderTwoViews` (TwoViews 224)
  moco-deferred  the same official pipeline; trainlab `FolderTwoViews` with `TwoViews(deferred=True)`: the loader
           workers' share under `trainlab train moco --augment-device cuda` (crops resized on 8-bit pixels and the
           draws; the jitter, greyscale, blur, solarize and flip then run batched on the GPU, not timed here)
  var      official VAR build_dataset: Resize(288, LANCZOS), RandomCrop(256), ToTensor, x -> 2x - 1; trainlab
           `ImageFolderDataset` (image side 256, random crop; only the crop is resampled, `lanczos_resize_crop`)
  lincls   official main_lincls.py train: RandomResizedCrop(224), RandomHorizontalFlip, ToTensor, Normalize;
           trainlab `ResizedCropFolder` (train)
  cifar    official CIFAR-10 recipe on the arrays (as torchvision's CIFAR10 returns them: Image.fromarray):
           RandomCrop(32, padding=4), RandomHorizontalFlip, ToTensor, Normalize; trainlab `CifarAugmentDataset`

Measurement: one thread (`torch.set_num_threads(1)`, the per-core rate a loader worker gets), one sample at a time
through `dataset[i]` (what a loader worker does, collation excluded), indices cycling over the data. Each round runs
every pipeline's official and trainlab side for `--seconds` each, alternating which goes first, so machine load
hits both alike; the result is the median over `--rounds` rounds of each side's samples/s and of the per-round
ratio trainlab / official.
"""

# Legend: none (samples are dicts of (3, S, S) tensors; no tensors are named here).

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torchvision.transforms as T
from _env import environment, result_path, settings, write_result
from PIL import Image, ImageFilter, ImageOps
from torchvision import datasets

from trainlab.data.cifar import CIFAR10_MEAN, CIFAR10_STD, CifarAugmentDataset
from trainlab.data.image_folder import ImageFolderDataset
from trainlab.data.resized_crops import ResizedCropFolder
from trainlab.data.ssl_views import FolderTwoViews
from trainlab.data.transforms import IMAGENET_MEAN, IMAGENET_STD, TwoViews

PIPELINES = ("moco", "moco-deferred", "var", "lincls", "cifar")
SIZES = [(500, 375)] * 4 + [(375, 500)] * 2 + [(500, 333), (333, 500), (640, 480), (1024, 768)]


# ------------------------------------------------------------------------------------------------ data
def write_jpeg_folder(root: Path, num_images: int, seed: int = 0) -> Path:
    """`num_images` synthetic JPEGs of ImageNet's typical sizes in two class folders under `root`."""
    rng = np.random.default_rng(seed)
    for i in range(num_images):
        w, h = SIZES[i % len(SIZES)]
        y, x = np.mgrid[0:h, 0:w].astype(np.float32)
        f = rng.uniform(10, 60, size=(3, 2))
        base = np.stack([128 + 100 * np.sin(x / f[c, 0] + c) * np.cos(y / f[c, 1] - c) for c in range(3)], -1)
        pixels = np.clip(base + rng.normal(0, 12, (h, w, 3)), 0, 255).astype(np.uint8)
        folder = root / f"class{i % 2}"
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(pixels).save(folder / f"img{i:04d}.jpg", "JPEG", quality=90)
    return root


# -------------------------------------------------------------------------------------- official pipelines
class OfficialGaussianBlur:
    """moco/loader.py GaussianBlur: PIL's GaussianBlur with a radius drawn from U(0.1, 2.0)."""

    def __init__(self, sigma: tuple[float, float] = (0.1, 2.0)) -> None:
        self.sigma = sigma

    def __call__(self, x: Image.Image) -> Image.Image:
        return x.filter(ImageFilter.GaussianBlur(radius=random.uniform(self.sigma[0], self.sigma[1])))


class OfficialSolarize:
    """moco/loader.py Solarize: ImageOps.solarize (threshold 128)."""

    def __call__(self, x: Image.Image) -> Image.Image:
        return ImageOps.solarize(x)


class OfficialTwoCrops:
    """moco/loader.py TwoCropsTransform."""

    def __init__(self, base1: Callable[[Image.Image], Any], base2: Callable[[Image.Image], Any]) -> None:
        self.base1, self.base2 = base1, base2

    def __call__(self, x: Image.Image) -> list[Any]:
        return [self.base1(x), self.base2(x)]


def official_moco(root: Path, crop_min: float = 0.08) -> datasets.ImageFolder:
    """main_moco.py: augmentation1 / augmentation2 (BYOL's), 224 px."""
    normalize = T.Normalize(mean=IMAGENET_MEAN, std=IMAGENET_STD)
    augmentation1 = [
        T.RandomResizedCrop(224, scale=(crop_min, 1.0)),
        T.RandomApply([T.ColorJitter(0.4, 0.4, 0.2, 0.1)], p=0.8),
        T.RandomGrayscale(p=0.2),
        T.RandomApply([OfficialGaussianBlur([0.1, 2.0])], p=1.0),  # type: ignore[arg-type]
        T.RandomHorizontalFlip(),
        T.ToTensor(),
        normalize,
    ]
    augmentation2 = [
        T.RandomResizedCrop(224, scale=(crop_min, 1.0)),
        T.RandomApply([T.ColorJitter(0.4, 0.4, 0.2, 0.1)], p=0.8),
        T.RandomGrayscale(p=0.2),
        T.RandomApply([OfficialGaussianBlur([0.1, 2.0])], p=0.1),  # type: ignore[arg-type]
        T.RandomApply([OfficialSolarize()], p=0.2),
        T.RandomHorizontalFlip(),
        T.ToTensor(),
        normalize,
    ]
    return datasets.ImageFolder(str(root), OfficialTwoCrops(T.Compose(augmentation1), T.Compose(augmentation2)))


def official_var(root: Path, final_reso: int = 256) -> datasets.ImageFolder:
    """VAR utils/data.py build_dataset, training transform (hflip off, as the official runs)."""
    mid_reso = round(1.125 * final_reso)
    return datasets.ImageFolder(
        str(root),
        T.Compose(
            [
                T.Resize(mid_reso, interpolation=T.InterpolationMode.LANCZOS),
                T.RandomCrop((final_reso, final_reso)),
                T.ToTensor(),
                lambda x: x.add(x).add_(-1),  # normalize_01_into_pm1
            ]
        ),
    )


def official_lincls(root: Path) -> datasets.ImageFolder:
    """main_lincls.py training transform."""
    return datasets.ImageFolder(
        str(root),
        T.Compose(
            [
                T.RandomResizedCrop(224),
                T.RandomHorizontalFlip(),
                T.ToTensor(),
                T.Normalize(mean=IMAGENET_MEAN, std=IMAGENET_STD),
            ]
        ),
    )


class OfficialCifar(torch.utils.data.Dataset[tuple[torch.Tensor, int]]):
    """torchvision's CIFAR10 __getitem__ (Image.fromarray) with the CIFAR-10 recipe's training transform."""

    def __init__(self, images_NHW3: np.ndarray, labels: list[int]) -> None:
        self.images_NHW3, self.labels = images_NHW3, labels
        self.transform = T.Compose(
            [
                T.RandomCrop(32, padding=4),
                T.RandomHorizontalFlip(),
                T.ToTensor(),
                T.Normalize(CIFAR10_MEAN, CIFAR10_STD),
            ]
        )

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.transform(Image.fromarray(self.images_NHW3[index])), self.labels[index]


# ----------------------------------------------------------------------------------------------- measuring
def build_pair(name: str, folder: Path, cifar_NHW3: np.ndarray) -> tuple[Any, Any]:
    """(official dataset, trainlab dataset) of one pipeline."""
    labels = [i % 10 for i in range(len(cifar_NHW3))]
    if name == "moco":
        return official_moco(folder), FolderTwoViews(folder, TwoViews(image_size=224, crop_min=0.08), seed=0)
    if name == "moco-deferred":
        views = TwoViews(image_size=224, crop_min=0.08, deferred=True)
        return official_moco(folder), FolderTwoViews(folder, views, seed=0)
    if name == "var":
        return official_var(folder), ImageFolderDataset(folder, image_size=256, train=True, seed=0)
    if name == "lincls":
        trainlab = ResizedCropFolder(folder, image_size=224, train=True, seed=0, mean=IMAGENET_MEAN, std=IMAGENET_STD)
        return official_lincls(folder), trainlab
    if name == "cifar":
        return OfficialCifar(cifar_NHW3, labels), CifarAugmentDataset(cifar_NHW3, labels, augment=True, seed=0)
    raise ValueError(name)


def samples_per_second(dataset: Any, seconds: float, start: int) -> tuple[float, int]:
    """Samples/s of `dataset[i]` for i cycling from `start`, over about `seconds`; and the next start index."""
    n, i = 0, start
    began = time.perf_counter()
    while True:
        dataset[i % len(dataset)]
        n, i = n + 1, i + 1
        elapsed = time.perf_counter() - began
        if elapsed >= seconds:
            return n / elapsed, i


def measure(names: list[str], folder: Path, cifar_NHW3: np.ndarray, args: argparse.Namespace) -> dict[str, Any]:
    pairs = {name: build_pair(name, folder, cifar_NHW3) for name in names}
    rates: dict[str, dict[str, list[float]]] = {n: {"official": [], "trainlab": [], "ratio": []} for n in names}
    starts = {(n, side): 0 for n in names for side in ("official", "trainlab")}
    for name in names:  # warm-up: file cache, lazy imports
        for dataset in pairs[name]:
            samples_per_second(dataset, 0.2, 0)
    for r in range(args.rounds):
        for name in names:
            order = ("official", "trainlab") if r % 2 == 0 else ("trainlab", "official")
            got = {}
            for side in order:
                dataset = pairs[name][0 if side == "official" else 1]
                got[side], starts[(name, side)] = samples_per_second(dataset, args.seconds, starts[(name, side)])
                rates[name][side].append(got[side])
            rates[name]["ratio"].append(got["trainlab"] / got["official"])
            print(
                f"round {r + 1}/{args.rounds} {name:13s} official {got['official']:8.1f}/s  trainlab "
                f"{got['trainlab']:8.1f}/s  ratio {got['trainlab'] / got['official']:.2f}",
                flush=True,
            )
    return {
        name: {
            "official_samples_per_second": round(statistics.median(r["official"]), 1),
            "trainlab_samples_per_second": round(statistics.median(r["trainlab"]), 1),
            "ratio": round(statistics.median(r["ratio"]), 2),
            "rounds": {k: [round(v, 2) for v in vs] for k, vs in r.items()},
        }
        for name, r in rates.items()
    }


def profile(name: str, folder: Path, cifar_NHW3: np.ndarray, seconds: float) -> str:
    """cProfile of both sides of one pipeline over `seconds` each: the top functions by own time."""
    out = io.StringIO()
    for side, dataset in zip(("official", "trainlab"), build_pair(name, folder, cifar_NHW3)):
        samples_per_second(dataset, 0.2, 0)
        prof = cProfile.Profile()
        prof.enable()
        rate, _ = samples_per_second(dataset, seconds, 0)
        prof.disable()
        out.write(f"\n=== {name} {side}: {rate:.1f} samples/s under the profiler\n")
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(14)
    return out.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pipelines", default=",".join(PIPELINES), help=f"comma-separated: {', '.join(PIPELINES)}")
    parser.add_argument("--images", type=int, default=40, help="synthetic JPEGs (and CIFAR arrays x 25)")
    parser.add_argument("--seconds", type=float, default=3.0, help="seconds per side per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", default="", help="print the profile of one pipeline instead of measuring")
    parser.add_argument("--label", default="", help="what to call this run in the result's file name")
    parser.add_argument("--json", default="auto", help="result path ('auto': results/data_<label>_<time>.json)")
    args = parser.parse_args()
    names = [n for n in args.pipelines.split(",") if n]
    unknown = sorted(set(names) - set(PIPELINES))
    if unknown:
        sys.exit(f"unknown pipeline(s) {', '.join(unknown)}; choose from {', '.join(PIPELINES)}")
    torch.set_num_threads(1)
    cifar_NHW3 = np.random.default_rng(0).integers(0, 256, size=(25 * args.images, 32, 32, 3), dtype=np.uint8)
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_jpeg_folder(Path(tmp) / "images", args.images)
        if args.profile:
            print(profile(args.profile, folder, cifar_NHW3, args.seconds))
            return
        results = measure(names, folder, cifar_NHW3, args)
    print(f"\n{'pipeline':13s} {'official/s':>11s} {'trainlab/s':>11s} {'ratio':>6s}   (one thread, medians)")
    for name, r in results.items():
        print(
            f"{name:13s} {r['official_samples_per_second']:11.1f} {r['trainlab_samples_per_second']:11.1f} "
            f"{r['ratio']:6.2f}"
        )
    write_result(
        result_path(args.json, "data", args.label),
        {"settings": settings(args), "environment": environment(), "pipelines": results},
    )


if __name__ == "__main__":
    main()
