"""`trainlab eval linear-probe --data.kind image-folder` on a tiny ImageNet-layout folder written to tmp_path: the run
prints its final-epoch accuracy; the train views (RandomResizedCrop + flip) are a pure function of (seed, epoch,
index); the eval transform is the official Resize(S * 256/224) + CenterCrop(S); the backbone never changes."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision.transforms.v2 as T
from PIL import Image

from trainlab.cli import main
from trainlab.data.resized_crops import ResizedCropFolder, ResizedCropTensors
from trainlab.data.transforms import IMAGENET_MEAN, IMAGENET_STD, random_resized_crop_flip, resize_center_crop
from trainlab.engine.loop import Trainer
from trainlab.recipes.linear_probe import LinearProbeConfig, LinearProbeRecipe, ProbeData

CLASSES = ("ant", "bee", "cat")
NORM = {"mean": IMAGENET_MEAN, "std": IMAGENET_STD}


def _write_png(path: Path, rng: np.random.Generator, class_id: int, height: int = 40, width: int = 48) -> None:
    pixels = rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    pixels[..., class_id] = 255  # one strong channel per class: learnable, yet every pixel differs
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path)


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """root/train/<class>/*.png (4 per class) and root/val/<class>/*.png (2 per class), 40 x 48 px."""
    rng = np.random.default_rng(0)
    root = tmp_path / "imagenet"
    for split, per_class in (("train", 4), ("val", 2)):
        for class_id, name in enumerate(CLASSES):
            for i in range(per_class):
                _write_png(root / split / name / f"{i}.png", rng, class_id)
    return root


def _json_line(out: str) -> dict[str, object]:
    lines = [line for line in out.strip().splitlines() if line.startswith("{")]
    assert len(lines) == 1, out
    return dict(json.loads(lines[0]))


def test_linear_probe_on_an_image_folder_prints_the_final_accuracy(
    tmp_path: Path, folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "lp"
    args = ["eval", "linear-probe", "--moco-weights", "", "--model", "tv_resnet_debug", "--data.kind", "image-folder"]
    args += ["--data.root", str(folder), "--image-size", "32", "--epochs", "2", "--batch-size", "4"]
    args += ["--run-dir", str(run), "--tensorboard", "false", "--progress", "false", "--eval-every-epochs", "1"]
    assert main(args) == 0
    printed = _json_line(capsys.readouterr().out)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    accs = [r["test_accuracy"] for r in rows if r["kind"] == "eval"]
    assert len(accs) == 2
    assert printed["final_test_accuracy"] == accs[-1]
    assert printed["best_epoch_test_accuracy (chosen on the test set)"] == max(accs)
    assert all(round(a * 6) == pytest.approx(a * 6) for a in accs)  # 6 val images


def test_folder_probe_has_one_output_per_class_and_leaves_the_backbone_unchanged(tmp_path: Path, folder: Path) -> None:
    cfg = dataclasses.replace(
        LinearProbeRecipe(LinearProbeConfig()).debug_config(),
        data=ProbeData(kind="image-folder", root=folder),
        image_size=32,
        batch_size=4,
        run_dir=tmp_path / "lp",
        tensorboard=False,
        progress=False,
    )
    recipe = LinearProbeRecipe(cfg)
    trainer = Trainer(recipe)
    backbone = trainer.parts.frozen["backbone"]
    before = {k: v.detach().clone() for k, v in backbone.state_dict().items()}
    classifier_before = trainer.parts.models["classifier"].weight.detach().clone()
    assert classifier_before.shape[0] == len(CLASSES)
    trainer.fit()
    assert any(k.endswith("running_var") for k in before)  # BN statistics are part of the comparison
    for key, value in backbone.state_dict().items():
        assert torch.equal(value, before[key]), key  # a train-mode forward would have moved BN statistics
    assert not backbone.training
    assert not torch.equal(trainer.parts.models["classifier"].weight, classifier_before)  # the probe did train


def test_train_views_are_a_pure_function_of_seed_epoch_index(folder: Path) -> None:
    def view(seed: int, epoch: int, index: int) -> torch.Tensor:
        ds = ResizedCropFolder(folder / "train", image_size=32, train=True, seed=seed, **NORM)  # fresh each time
        ds.set_epoch(epoch)
        return ds[index]["image"]

    first = view(0, 3, 5)
    assert first.shape == (3, 32, 32) and first.dtype == torch.float32
    assert torch.equal(first, view(0, 3, 5))
    assert not torch.equal(first, view(0, 4, 5))  # another epoch: another crop
    assert not torch.equal(first, view(1, 3, 5))  # another seed
    # the dataset's view is the pure function applied to the decoded image
    img = torch.from_numpy(np.array(Image.open(sorted((folder / "train" / "bee").iterdir())[1]))).permute(2, 0, 1)
    assert torch.equal(first, random_resized_crop_flip(img, 32, seed=0, epoch=3, index=5, **NORM))

    images = torch.randint(0, 256, (6, 3, 32, 32), dtype=torch.uint8)
    views = ResizedCropTensors(images, torch.arange(6), image_size=32, seed=0, **NORM)  # CIFAR-10 in memory
    views.set_epoch(2)
    a = views[4]["image"]
    assert torch.equal(a, random_resized_crop_flip(images[4], 32, seed=0, epoch=2, index=4, **NORM))
    views.set_epoch(3)
    assert not torch.equal(a, views[4]["image"])


def test_eval_transform_is_the_official_resize_and_center_crop(folder: Path) -> None:
    official = T.Compose([T.Resize(256, antialias=True), T.CenterCrop(224), T.Normalize(IMAGENET_MEAN, IMAGENET_STD)])
    big = torch.rand(3, 300, 400)
    assert torch.allclose(resize_center_crop(big, 224, **NORM), official(big), atol=1e-6)

    val = ResizedCropFolder(folder / "val", image_size=32, train=False, **NORM)
    path = folder / "val" / "cat" / "1.png"
    img = torch.from_numpy(np.array(Image.open(path))).permute(2, 0, 1)
    at_32 = T.Compose([T.ToDtype(torch.float32, scale=True), T.Resize(37, antialias=True), T.CenterCrop(32)])
    expected = T.Normalize(IMAGENET_MEAN, IMAGENET_STD)(at_32(img))  # 256/224 * 32 = 36.6 -> 37
    position = [rel for rel, _ in val.index.files].index("cat/1.png")
    val.set_epoch(0)
    item = val[position]
    assert torch.allclose(item["image"], expected, atol=1e-6) and int(item["label"]) == 2
    val.set_epoch(7)
    assert torch.equal(val[position]["image"], item["image"])  # no randomness at eval


def test_mismatched_class_folders_are_one_line(
    tmp_path: Path, folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _write_png(folder / "val" / "dog" / "0.png", np.random.default_rng(1), 0)
    args = ["eval", "linear-probe", "--moco-weights", "", "--data.kind", "image-folder", "--data.root", str(folder)]
    assert main([*args, "--image-size", "32", "--run-dir", str(tmp_path / "lp")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "have different class folders" in err[0], err


def test_cifar10_trains_on_random_resized_crop_and_flip(tmp_path: Path) -> None:
    """--data.kind cifar10 trains on `ResizedCropTensors` (the official crop + flip at 32 px, CIFAR-10 statistics);
    --augment false trains on the normalised images as they are; --data.train-limit keeps the first N."""
    from trainlab.data.cifar import CIFAR10_MEAN, CIFAR10_STD, load_cifar10
    from trainlab.data.fake_cifar import write_fake_cifar10
    from trainlab.data.transforms import normalise

    root = write_fake_cifar10(tmp_path / "cifar", num_train=20, num_test=10)
    raw = load_cifar10(root, train=True)
    images = torch.from_numpy(raw.data).permute(0, 3, 1, 2)
    data = ProbeData(kind="cifar10", root=root, train_limit=5)
    cfg = LinearProbeConfig(data=data, image_size=32, seed=4, run_dir=tmp_path / "lp")
    ds = LinearProbeRecipe(cfg).build_data(None, torch.device("cpu"))  # type: ignore[arg-type]
    assert isinstance(ds, ResizedCropTensors) and len(ds) == 5
    ds.set_epoch(1)
    expected = random_resized_crop_flip(images[3], 32, seed=4, epoch=1, index=3, mean=CIFAR10_MEAN, std=CIFAR10_STD)
    assert torch.equal(ds[3]["image"], expected) and int(ds[3]["label"]) == raw.targets[3]
    plain = LinearProbeRecipe(dataclasses.replace(cfg, augment=False)).build_data(None, torch.device("cpu"))  # type: ignore[arg-type]
    assert not isinstance(plain, ResizedCropTensors) and len(plain) == 5  # type: ignore[arg-type]
    assert torch.equal(plain[3]["image"], normalise(images[3:4], CIFAR10_MEAN, CIFAR10_STD)[0])
