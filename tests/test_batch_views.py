"""MoCo's views finished on a batch (`--augment-device`): the same draws as the per-image path, images equal to it
within float rounding on the CPU device, the engine's `prepare_batch` hook, and the refusals."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import default_collate

from trainlab.cli import main
from trainlab.data.batch_views import adjust_views
from trainlab.data.ssl_views import FolderTwoViews, TensorTwoViews
from trainlab.data.transforms import TwoViews, two_view_draws, view_rng
from trainlab.engine.debug import debug_run_config
from trainlab.engine.loop import Trainer
from trainlab.recipes.moco import MocoConfig, MocoRecipe

# Largest difference allowed between the batched and the per-image views, in normalised units (x / std: about
# 4.5e-6 of the [0, 1] pixel range at std 0.225, a thousandth of one 8-bit level, 1/255): float rounding only.
TOLERANCE = 2e-5
SPEC = TwoViews(image_size=24, crop_min=0.08, blur=True)


def _jpegs(root: Path, count: int = 24) -> Path:
    rng = np.random.default_rng(0)
    (root / "train" / "a").mkdir(parents=True)
    for i in range(count):
        h, w = (50, 70) if i % 2 else (64, 40)
        ramp = np.linspace(0, 255, w, dtype=np.float64)[None, :, None]
        pixels = np.clip(ramp + rng.normal(0, 40, size=(h, w, 3)), 0, 255).astype(np.uint8)
        Image.fromarray(pixels).save(root / "train" / "a" / f"{i}.jpg", quality=90)
    return root / "train"


def _pairs(host: torch.utils.data.Dataset, deferred: torch.utils.data.Dataset, n: int) -> tuple[dict, dict]:
    host_batch = default_collate([host[i] for i in range(n)])
    deferred_batch = default_collate([deferred[i] for i in range(n)])
    return host_batch, deferred_batch


@pytest.mark.parametrize("kind", ["folder-uint8", "tensor-float"])
def test_batched_views_equal_the_per_image_views(tmp_path: Path, kind: str) -> None:
    deferred_spec = dataclasses.replace(SPEC, deferred=True)
    if kind == "folder-uint8":
        root = _jpegs(tmp_path)
        host, deferred = FolderTwoViews(root, SPEC, seed=3), FolderTwoViews(root, deferred_spec, seed=3)
        n = 24
    else:
        images = torch.rand(48, 3, 30, 26, generator=torch.Generator().manual_seed(0))
        labels = torch.zeros(48, dtype=torch.long)
        host = TensorTwoViews(images, labels, SPEC, seed=3)
        deferred = TensorTwoViews(images, labels, deferred_spec, seed=3)
        n = 48
    for data in (host, deferred):
        data.set_epoch(2)
    host_batch, deferred_batch = _pairs(host, deferred, n)
    if kind == "folder-uint8":
        assert deferred_batch["view1"].dtype == torch.uint8  # 8-bit crops travel, not floats
    done = adjust_views(deferred_batch, SPEC)
    assert set(done) == {"view1", "view2", "label"}
    for view in ("view1", "view2"):
        assert done[view].dtype == host_batch[view].dtype and done[view].shape == host_batch[view].shape
        worst = (done[view] - host_batch[view]).abs().max().item()
        assert worst <= TOLERANCE, (view, worst)
    # every adjustment was exercised: jitter, grey, blur, solarize, flip (so the comparison can fail)
    rows = torch.cat([deferred_batch["view1_draws"], deferred_batch["view2_draws"]])
    for column in (0, 9, 11, 12, 13):
        assert 0 < int((rows[:, column] > 0.5).sum()) < len(rows), column


def test_the_draws_are_the_per_image_paths(tmp_path: Path) -> None:
    """Every number a batch carries is `two_view_draws` of (seed, epoch, index): workers draw, the device applies."""
    root = _jpegs(tmp_path, count=6)
    deferred = FolderTwoViews(root, dataclasses.replace(SPEC, deferred=True), seed=5)
    deferred.set_epoch(1)
    for index in range(6):
        sample = deferred[index]
        _, h, w = deferred._sample(index)[0].shape
        draws = two_view_draws(SPEC, h, w, view_rng(5, 1, index))
        for view, expected in zip(("view1", "view2"), draws, strict=True):
            assert sample[f"{view}_draws"].tolist() == expected.row()


def _config(run_dir: Path, **kw: object) -> MocoConfig:
    cfg = debug_run_config(MocoRecipe(MocoConfig()))
    base = dict(run_dir=run_dir, tensorboard=False, progress=False, blur=True, max_steps=3)
    return dataclasses.replace(cfg, **{**base, **kw})  # type: ignore[arg-type]


def test_the_engine_prepares_batches_through_the_recipe(tmp_path: Path) -> None:
    """MoCo with the views finished by `prepare_batch` (on the CPU device here) trains to the per-image path's
    losses within float rounding; the loader's batches carry crops and draws."""
    host = Trainer(MocoRecipe(_config(tmp_path / "host"))).fit().losses
    recipe = MocoRecipe(_config(tmp_path / "batched"))
    recipe.batched_views = True  # what --augment-device cuda selects, on the CPU device
    trainer = Trainer(recipe)
    trainer.sampler.set_epoch(0)
    assert "view1_draws" in next(iter(trainer.loader))
    batched = trainer.fit().losses
    assert len(batched) == len(host) == 3
    assert batched == pytest.approx(host, rel=1e-4)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_augment_device_cuda_without_cuda_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["train", "moco", "--augment-device", "cuda", "--run-dir", str(tmp_path / "r")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith("--augment-device cuda needs a CUDA GPU and none is visible; use cpu")


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--augment-device", "gpu"], "unknown --augment-device 'gpu'; use cpu, cuda or cuda:N (the run's GPU)"),
        (["--augment-device", "cuda:x"], "unknown --augment-device 'cuda:x'; use cpu, cuda or cuda:N"),
        (["--augment-device", "cuda", "--device", "cpu"], "--augment-device cuda with --device cpu; use"),
    ],
)
def test_an_unusable_augment_device_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], words: str
) -> None:
    assert main(["train", "moco", *argv, "--run-dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert words in err[-1]
