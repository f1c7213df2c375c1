"""`open_split`, the one dispatcher from a data config to a dataset: every kind through every transform it reads,
limits, held-out splits, class counts, and the one-line errors."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from trainlab.data.config import DataConfig
from trainlab.data.fake_cifar import write_fake_cifar10
from trainlab.data.image_folder import ImageFolderDataset
from trainlab.data.resized_crops import ResizedCropFolder, ResizedCropTensors
from trainlab.data.sources import eval_images, normalisation, num_classes, open_split, stacked
from trainlab.data.ssl_views import FolderTwoViews, TensorTwoViews
from trainlab.data.tensors import MapImage, NamedTensorDataset, TensorImageDataset
from trainlab.data.transforms import (
    HALF,
    Normalise,
    PadCropFlip,
    RandomResizedCropFlip,
    ResizeCenterCrop,
    TwoViews,
    VarResizeCrop,
    normalise,
)
from trainlab.errors import UsageError

CLASSES = ("ant", "bee", "cat")


def _folder(root: Path, per_class: int = 4, val: bool = True, classes: tuple[str, ...] = CLASSES) -> Path:
    rng = np.random.default_rng(0)
    for split, count in (("train", per_class), ("val", 2)):
        if split == "val" and not val:
            continue
        for class_id, name in enumerate(classes):
            (root / split / name).mkdir(parents=True, exist_ok=True)
            for i in range(count):
                pixels = rng.integers(0, 256, size=(20, 24, 3), dtype=np.uint8)
                pixels[..., class_id % 3] = 255
                Image.fromarray(pixels).save(root / split / name / f"{i}.png")
    return root


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    return _folder(tmp_path / "imgs")


@pytest.fixture
def cifar(tmp_path: Path) -> Path:
    return write_fake_cifar10(tmp_path / "cifar", num_train=20, num_test=10)


TRANSFORMS = {
    "var": VarResizeCrop(16, crop="random", flip="random"),
    "two_views": TwoViews(16, blur=False, mean=HALF, std=HALF),
    "random_resized": RandomResizedCropFlip(16),
    "resize_center": ResizeCenterCrop(16),
    "normalise": Normalise(16, HALF, HALF),
}
FOLDER_DATASETS = {
    "var": ImageFolderDataset,
    "two_views": FolderTwoViews,
    "random_resized": ResizedCropFolder,
    "resize_center": ResizedCropFolder,
    "normalise": MapImage,
}
MEMORY_DATASETS = {
    "var": TensorImageDataset,
    "two_views": TensorTwoViews,
    "random_resized": ResizedCropTensors,
    "resize_center": NamedTensorDataset,
    "normalise": NamedTensorDataset,
}


@pytest.mark.parametrize("transform", sorted(TRANSFORMS))
def test_an_image_folder_through_every_transform(folder: Path, transform: str) -> None:
    split = open_split(DataConfig(kind="image-folder", root=folder), "train", TRANSFORMS[transform], seed=3)
    assert split is not None and split.num_classes == 3 and len(split.images) == 12  # type: ignore[arg-type]
    assert isinstance(split.images, FOLDER_DATASETS[transform])
    sample = split.images[5]
    keys = {"view1", "view2", "label"} if transform == "two_views" else {"image", "label"}
    assert set(sample) == keys and int(sample["label"]) == 1
    assert all(sample[k].shape == (3, 16, 16) for k in keys - {"label"})
    assert split.description["kind"] == "image-folder" and split.description["size"] == 12


@pytest.mark.parametrize("kind", ["digits", "fake"])
@pytest.mark.parametrize("transform", sorted(TRANSFORMS))
def test_in_memory_kinds_through_every_transform(kind: str, transform: str) -> None:
    data = DataConfig(kind=kind, fake_size=24, train_limit=20)  # type: ignore[arg-type]
    split = open_split(data, "train", TRANSFORMS[transform], seed=3, fake_classes=4)
    assert split is not None and len(split.images) == 20  # type: ignore[arg-type]
    assert isinstance(split.images, MEMORY_DATASETS[transform])
    sample = split.images[7]
    image = sample["view1" if transform == "two_views" else "image"]
    assert image.shape == (3, 16, 16) and image.dtype == torch.float32
    assert split.num_classes == (10 if kind == "digits" else 4)


def test_cifar10_through_its_transforms(cifar: Path) -> None:
    data = DataConfig(kind="cifar10", root=cifar, eval_limit=6)
    mean, std = normalisation("cifar10")
    train = open_split(data, "train", PadCropFlip(mean, std), seed=1)
    test = open_split(data, "eval", Normalise(32, mean, std))
    assert train is not None and test is not None
    assert len(train.images) == 20 and len(test.images) == 6  # type: ignore[arg-type]
    assert train.images[0]["image"].shape == (3, 32, 32)
    views = open_split(data, "train", TwoViews(32, blur=False, mean=mean, std=std))
    assert views is not None and isinstance(views.images, TensorTwoViews)


def test_limits_keep_the_first_images_in_memory_and_every_class_in_a_folder(tmp_path: Path) -> None:
    digits = DataConfig(kind="digits", train_limit=7, eval_limit=5)
    full = open_split(DataConfig(kind="digits"), "train", Normalise(16, HALF, HALF))
    first = open_split(digits, "train", Normalise(16, HALF, HALF))
    held = open_split(digits, "eval", Normalise(16, HALF, HALF))
    assert full is not None and first is not None and held is not None
    assert len(full.images) == 4000 and len(first.images) == 7 and len(held.images) == 5  # type: ignore[arg-type]
    assert torch.equal(stacked(first)[0], stacked(full)[0][:7])
    root = _folder(tmp_path / "big", per_class=5)
    limited = open_split(DataConfig(kind="image-folder", root=root, train_limit=3), "train", VarResizeCrop(8))
    assert limited is not None and sorted(stacked(limited)[1].tolist()) == [0, 1, 2]  # one image of each class
    assert limited.description["limit"] == 3


def test_the_digits_split_is_one_for_every_seed() -> None:
    """Pretraining (MoCo, any seed) and a probe's test images never overlap: the split does not follow the seed."""
    a = open_split(DataConfig(kind="digits"), "eval", Normalise(16, HALF, HALF), seed=0)
    b = open_split(DataConfig(kind="digits"), "eval", Normalise(16, HALF, HALF), seed=7)
    assert a is not None and b is not None and torch.equal(stacked(a)[0], stacked(b)[0])


def test_a_folder_without_val_has_no_eval_split(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = _folder(tmp_path / "noval", val=False)
    with caplog.at_level(logging.WARNING):
        assert open_split(DataConfig(kind="image-folder", root=root), "eval", VarResizeCrop(8)) is None
    assert "no held-out folder" in caplog.text and "evaluation is off" in caplog.text
    with pytest.raises(UsageError, match="a kNN evaluation needs held-out images"):
        eval_images(DataConfig(kind="image-folder", root=root), 8)


def test_folder_errors_are_one_line(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=r"--data\.root .*nowhere not found: pass a folder holding train/"):
        open_split(DataConfig(kind="image-folder", root=tmp_path / "nowhere"), "train", VarResizeCrop(8))
    root = _folder(tmp_path / "odd")
    _folder(root, classes=("ant", "bee", "cat", "dog"), val=True)  # val/ (and train/) gain a class...
    (root / "train" / "dog" / "0.png").unlink()  # ...which train/ then loses again
    for i in range(1, 4):
        (root / "train" / "dog" / f"{i}.png").unlink()
    (root / "train" / "dog").rmdir()
    with pytest.raises(UsageError, match="have different class folders"):
        open_split(DataConfig(kind="image-folder", root=root), "eval", VarResizeCrop(8))


def test_a_transform_that_cannot_read_a_kind_is_a_programming_error(folder: Path, cifar: Path) -> None:
    mean, std = normalisation("cifar10")
    with pytest.raises(ValueError, match="PadCropFlip applies to CIFAR-format images, not to an image folder"):
        open_split(DataConfig(kind="image-folder", root=folder), "train", PadCropFlip(mean, std))
    with pytest.raises(ValueError, match="PadCropFlip has no image side to make digits images at"):
        open_split(DataConfig(kind="digits"), "train", PadCropFlip(mean, std))


def test_class_counts_are_known_without_reading_images(folder: Path) -> None:
    assert num_classes(DataConfig(kind="image-folder", root=folder)) == 3
    assert num_classes(DataConfig(kind="digits")) == num_classes(DataConfig(kind="cifar10")) == 10
    assert num_classes(DataConfig(kind="fake"), fake_classes=4) == 4


def test_eval_images_are_the_bank_and_queries_normalised(folder: Path) -> None:
    images = eval_images(DataConfig(kind="digits", eval_limit=30), 16)
    assert images.bank_N3HW.shape == (30, 3, 16, 16) and images.query_N3HW.shape == (30, 3, 16, 16)
    raw = open_split(DataConfig(kind="digits", train_limit=30), "train", VarResizeCrop(16))
    assert raw is not None
    unit = stacked(raw)[0].add(1.0).div(2.0)
    assert torch.equal(images.bank_N3HW, normalise(unit, HALF, HALF)) and images.num_classes == 10
    from_folder = eval_images(DataConfig(kind="image-folder", root=folder, eval_limit=4), 8)
    assert from_folder.bank_N3HW.shape == (4, 3, 8, 8) and from_folder.query_N3HW.shape == (4, 3, 8, 8)
    assert from_folder.num_classes == 3


def test_normalised_folder_images_pass_the_epoch_on(folder: Path) -> None:
    split = open_split(DataConfig(kind="image-folder", root=folder), "eval", Normalise(8, HALF, HALF))
    assert split is not None and isinstance(split.images, MapImage)
    split.images.set_epoch(3)
    assert split.images.skipped_images == 0 and split.images[0]["image"].shape == (3, 8, 8)


# ------------------------------------------------------------------------------------------- the fake kind
def test_fake_images_are_one_data_set_whatever_the_seed_or_the_reader(tmp_path: Path) -> None:
    """Every recipe's fake images come from one generator: in memory at any side and class count, or written in
    CIFAR-10's file format and read back by the CIFAR-10 reader; the run's seed changes augmentation, not data."""
    data = DataConfig(kind="fake", fake_size=40)
    mean, std = normalisation("fake")
    a = open_split(data, "train", Normalise(32, mean, std), seed=0)
    b = open_split(data, "train", Normalise(32, mean, std), seed=9)
    files = open_split(data, "train", Normalise(32, mean, std), fake_files=tmp_path / "fake")
    assert a is not None and b is not None and files is not None
    assert torch.equal(stacked(a)[0], stacked(b)[0]) and torch.equal(stacked(a)[0], stacked(files)[0])
    assert torch.equal(stacked(a)[1], stacked(files)[1])
    assert (tmp_path / "fake" / "train40-test16" / "cifar-10-batches-py" / "test_batch").is_file()
    held = open_split(data, "eval", Normalise(32, mean, std))
    assert held is not None and len(held.images) == 16 and held.num_classes == 10  # type: ignore[arg-type]


def test_fake_images_are_signed_for_var_and_learnable() -> None:
    split = open_split(DataConfig(kind="fake", fake_size=64), "train", VarResizeCrop(16), fake_classes=4)
    assert split is not None and isinstance(split.images, TensorImageDataset)
    images_N3HW, labels_N = split.images.images_N3HW, split.images.labels_N
    assert images_N3HW.dtype == torch.float32 and float(images_N3HW.min()) >= -1 and float(images_N3HW.max()) <= 1
    assert torch.bincount(labels_N).tolist() == [16, 16, 16, 16]  # balanced
    colour_K3 = torch.stack([images_N3HW[labels_N == k].mean(dim=(0, 2, 3)) for k in range(4)])
    assert float(torch.cdist(colour_K3, colour_K3).add(torch.eye(4) * 9).min()) > 0.1  # classes look different


def test_the_synthetic_bytes_are_fixed() -> None:
    """The generator is float64 so its bytes do not depend on the CPU: a change of them is a change of every fake
    data set (and of the golden losses)."""
    import hashlib

    from trainlab.data.synthetic import synthetic_splits

    train, held_out = synthetic_splits(6, 2, image_size=8, num_classes=3)
    digest = hashlib.sha256(train.images_N3SS.tobytes() + held_out.images_N3SS.tobytes()).hexdigest()
    assert train.labels_N.tolist() == [0, 2, 0, 1, 1, 2] and held_out.labels_N.tolist() == [1, 0]  # balanced, mixed
    assert digest == "134d80653300c93cb97e502ed19dfd981b3cbf27e3c2cbaa773fcb987edd144e"


def test_the_synthetic_bytes_do_not_depend_on_the_chunk_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """The images are made a few at a time: chunks of 1, 3 and all images give the same bytes (the noise stream is
    drawn in the same order)."""
    from trainlab.data import synthetic

    made = []
    for images_per_chunk in (1, 3, 1000):
        monkeypatch.setattr(synthetic, "CHUNK_VALUES", images_per_chunk * 3 * 9 * 9)
        train, held_out = synthetic.synthetic_splits(7, 5, image_size=9, num_classes=3)
        made.append(train.images_N3SS.tobytes() + held_out.images_N3SS.tobytes() + train.labels_N.tobytes())
    assert made[0] == made[1] == made[2]
