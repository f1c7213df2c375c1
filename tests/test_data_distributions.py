"""The random choices trainlab's pipelines draw (from seed, epoch and index) follow the official pipelines'
distributions (torchvision's `get_params`, `random` and torch's global RNG): two-sample Kolmogorov-Smirnov tests for
crop boxes, jitter factors and blur sigmas, binomial tests for application rates, over a few thousand draws.

The draws are recorded while trainlab's own transforms run (the operations they call are wrapped), so what is tested
is what the pipeline does. Every test is deterministic (fixed seeds); the threshold p > 1e-3 and a wrong setting
(crop-min 0.2 against the official 0.08) is shown to fail it.
"""

from __future__ import annotations

import random
from collections import Counter, defaultdict
from typing import Any

import pytest
import torch
import torchvision.transforms as T
import torchvision.transforms.v2.functional as TF2
from scipy import stats

from trainlab.data import transforms
from trainlab.data.augment import augment_draws, mixed_radix_digits
from trainlab.data.transforms import TwoViews, pad_crop_flip_draws, random_resized_crop_box

N = 3000
P_MIN = 1e-3
HEIGHT, WIDTH = 375, 500


def _same(a: list[float], b: list[float]) -> bool:
    return bool(stats.ks_2samp(a, b).pvalue > P_MIN)


def _rate(hits: int, n: int, p: float) -> bool:
    return bool(stats.binomtest(hits, n, p).pvalue > P_MIN)


class _Recorder:
    """Wraps a module's functions: records (name, args) of each call and forwards it."""

    def __init__(self, module: Any, calls: list[tuple[str, tuple[Any, ...]]]) -> None:
        self._module, self._calls = module, calls

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._module, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            self._calls.append((name, args[1:]))
            return fn(*args, **kwargs)

        return call


def _record_two_views(monkeypatch: pytest.MonkeyPatch, n: int) -> list[list[tuple[str, tuple[Any, ...]]]]:
    """The calls of view 1 and view 2 of `n` samples of a tiny image (the draws do not depend on the pixels)."""
    calls: list[tuple[str, tuple[Any, ...]]] = []
    monkeypatch.setattr(transforms, "TF2", _Recorder(TF2, calls))
    for name in ("adjust_hue", "gaussian_blur", "random_resized_crop_box"):
        fn = getattr(transforms, name)
        monkeypatch.setattr(transforms, name, lambda *a, _n=name, _f=fn: calls.append((_n, a[1:])) or _f(*a))
    spec = TwoViews(image_size=9, crop_min=0.08)
    img = torch.rand(3, 30, 40)
    views = []
    for index in range(n):
        calls.clear()
        rng = random.Random(transforms.draw_words(0, 0, index, num_words=1)[0])
        for p_blur, p_solarize in ((1.0, 0.0), (0.1, 0.2)):
            start = len(calls)
            transforms.one_view(img, rng, spec, p_blur=p_blur, p_solarize=p_solarize)
            views.append(calls[start:])
    return views


def _official_boxes(crop_min: float, n: int, height: int = HEIGHT, width: int = WIDTH) -> list[tuple[int, ...]]:
    torch.manual_seed(0)
    img = torch.zeros(3, height, width)
    return [tuple(T.RandomResizedCrop.get_params(img, (crop_min, 1.0), (3 / 4, 4 / 3))) for _ in range(n)]


def _trainlab_boxes(crop_min: float, n: int) -> list[tuple[int, ...]]:
    rngs = (random.Random(transforms.draw_words(0, 0, i, num_words=1)[0]) for i in range(n))
    return [random_resized_crop_box(rng, HEIGHT, WIDTH, crop_min) for rng in rngs]


@pytest.mark.parametrize("crop_min", [0.08, 0.2])
def test_crop_boxes_follow_random_resized_crop(crop_min: float) -> None:
    ours, official = _trainlab_boxes(crop_min, N), _official_boxes(crop_min, N)
    for k, name in enumerate(("top", "left", "height", "width")):
        assert _same([b[k] for b in ours], [b[k] for b in official]), name
    area = [b[2] * b[3] / (HEIGHT * WIDTH) for b in ours]
    assert min(area) >= crop_min * 0.9 and max(area) <= 1.0


def test_a_different_crop_scale_fails_the_test() -> None:
    ours, official = _trainlab_boxes(0.2, N), _official_boxes(0.08, N)
    assert not _same([b[2] * b[3] for b in ours], [b[2] * b[3] for b in official])


def test_two_views_draw_the_official_jitter_grey_blur_solarize_and_flip(monkeypatch: pytest.MonkeyPatch) -> None:
    views = _record_two_views(monkeypatch, N // 2)
    factors: dict[str, list[float]] = defaultdict(list)
    counts: Counter[tuple[int, str]] = Counter()
    first_op: Counter[str] = Counter()
    sigmas: list[float] = []
    for i, calls in enumerate(views):
        view = i % 2
        names = [name for name, _ in calls]
        jitter = [(name, args) for name, args in calls if name.startswith("adjust_")]
        if jitter:
            counts[(view, "jitter")] += 1
            first_op[jitter[0][0]] += 1
            for name, args in jitter:
                factors[name].append(float(args[0]))
        for name in ("rgb_to_grayscale", "gaussian_blur", "solarize", "horizontal_flip"):
            counts[(view, name)] += name in names
        sigmas += [float(args[1]) for name, args in calls if name == "gaussian_blur"]
    n = len(views) // 2
    torch.manual_seed(0)
    official = [T.ColorJitter.get_params((0.6, 1.4), (0.6, 1.4), (0.8, 1.2), (-0.1, 0.1)) for _ in range(N)]
    for k, name in enumerate(("adjust_brightness", "adjust_contrast", "adjust_saturation", "adjust_hue"), start=1):
        assert _same(factors[name], [float(o[k]) for o in official]), name
    assert all(_rate(counts[(v, "jitter")], n, 0.8) for v in (0, 1))
    assert all(_rate(counts[(v, "rgb_to_grayscale")], n, 0.2) for v in (0, 1))
    assert counts[(0, "gaussian_blur")] == n and _rate(counts[(1, "gaussian_blur")], n, 0.1)
    assert counts[(0, "solarize")] == 0 and _rate(counts[(1, "solarize")], n, 0.2)
    assert all(_rate(counts[(v, "horizontal_flip")], n, 0.5) for v in (0, 1))
    assert stats.chisquare(list(first_op.values())).pvalue > P_MIN and len(first_op) == 4  # a random order
    official_sigmas = [random.Random(i).uniform(0.1, 2.0) for i in range(N)]  # moco/loader.py GaussianBlur
    assert _same(sigmas, official_sigmas)


def test_var_random_crop_offsets_follow_random_crop() -> None:
    out_h, out_w, side = 288, 384, 256
    ours = [mixed_radix_digits(augment_draws(0, 0, i)[0], out_h - side + 1, out_w - side + 1) for i in range(N)]
    torch.manual_seed(0)
    official = [T.RandomCrop.get_params(torch.zeros(3, out_h, out_w), (side, side))[:2] for _ in range(N)]
    assert _same([o[0] for o in ours], [o[0] for o in official])
    assert _same([o[1] for o in ours], [o[1] for o in official])


def test_linear_probe_crop_and_flip_follow_main_lincls() -> None:
    draws = [augment_draws(0, 0, i) for i in range(N)]
    ours = [random_resized_crop_box(random.Random(d[0]), HEIGHT, WIDTH, transforms.CROP_MIN) for d in draws]
    official = _official_boxes(0.08, N)
    for k in range(4):
        assert _same([b[k] for b in ours], [b[k] for b in official])
    assert _rate(sum(d[1] & 1 for d in draws), N, 0.5)


def test_cifar_pad_crop_flip_follows_random_crop_padding_4() -> None:
    ours = [pad_crop_flip_draws(0, 0, i) for i in range(N)]
    torch.manual_seed(0)
    official = [T.RandomCrop.get_params(torch.zeros(3, 40, 40), (32, 32))[:2] for _ in range(N)]
    for k in range(2):
        assert (
            stats.chi2_contingency(
                [
                    list(Counter(o[k] for o in ours)[v] for v in range(9)),
                    list(Counter(o[k] for o in official)[v] for v in range(9)),
                ]
            ).pvalue
            > P_MIN
        )
    assert _rate(sum(o[2] for o in ours), N, 0.5)
