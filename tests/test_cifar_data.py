"""CIFAR-10 loading (the restricted reader on a fake dataset in the official layout) and deterministic augmentation."""

from __future__ import annotations

import os
import pickle
import urllib.error
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader
from torchvision.transforms.v2 import functional as TF

from trainlab.data.cifar import CIFAR10_MEAN, CIFAR10_STD, CifarAugmentDataset, load_cifar10
from trainlab.data.fake_cifar import write_fake_cifar10
from trainlab.data.transforms import pad_crop_flip, pad_crop_flip_draws
from trainlab.errors import UsageError
from trainlab.models.registry import create_model


@pytest.fixture(scope="module")
def fake_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_fake_cifar10(tmp_path_factory.mktemp("cifar"), num_train=100, num_test=30, seed=0)


def test_fake_dataset_loads_like_torchvision(fake_root: Path) -> None:
    train = load_cifar10(fake_root, train=True)
    test = load_cifar10(fake_root, train=False)
    assert train.data.shape == (100, 32, 32, 3) and train.data.dtype == np.uint8
    assert test.data.shape == (30, 32, 32, 3)
    assert np.bincount(train.targets).tolist() == [10] * 10
    assert train.classes[0] == "airplane" and len(train.classes) == 10
    files = sorted(p.name for p in (fake_root / "cifar-10-batches-py").iterdir())
    assert files == [
        "batches.meta",
        "data_batch_1",
        "data_batch_2",
        "data_batch_3",
        "data_batch_4",
        "data_batch_5",
        "test_batch",
    ]
    with open(fake_root / "cifar-10-batches-py" / "data_batch_1", "rb") as f:
        entry = pickle.load(f, encoding="latin1")
    assert set(entry) == {"batch_label", "labels", "data", "filenames"}
    assert entry["data"].shape == (20, 3072) and entry["data"].dtype == np.uint8


def test_fake_dataset_is_reproducible(tmp_path: Path, fake_root: Path) -> None:
    again = load_cifar10(write_fake_cifar10(tmp_path, num_train=100, num_test=30, seed=0), train=True)
    assert np.array_equal(again.data, load_cifar10(fake_root, train=True).data)
    other = load_cifar10(write_fake_cifar10(tmp_path / "other", num_train=100, num_test=30, seed=1), train=True)
    assert not np.array_equal(other.data, again.data)


def test_arrays_equal_torchvisions_reading_of_the_same_files(fake_root: Path) -> None:
    from torchvision.datasets import CIFAR10

    class Unchecked(CIFAR10):  # torchvision md5-checks every file against the official release: off for fake data
        train_list: ClassVar[list[list[str | None]]] = [[name, None] for name, _md5 in CIFAR10.train_list]
        test_list: ClassVar[list[list[str | None]]] = [[name, None] for name, _md5 in CIFAR10.test_list]
        meta: ClassVar[dict[str, str | None]] = {**CIFAR10.meta, "md5": None}

    for train in (True, False):
        ours, reference = load_cifar10(fake_root, train=train), Unchecked(fake_root, train=train)
        assert np.array_equal(ours.data, reference.data) and ours.data.strides == reference.data.strides
        assert ours.targets == reference.targets and ours.classes == reference.classes


def test_missing_root_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(UsageError) as info:
        load_cifar10(tmp_path / "nowhere", train=True)
    message = str(info.value)
    assert message == (
        f"CIFAR-10 not found under {tmp_path / 'nowhere'} (expected {tmp_path / 'nowhere' / 'cifar-10-batches-py'}); "
        "pass --data.download to fetch it, or --data.root to point at it"
    )
    assert "\n" not in message


def test_incomplete_and_corrupt_dataset_errors(tmp_path: Path) -> None:
    root = write_fake_cifar10(tmp_path, num_train=20, num_test=10)
    folder = root / "cifar-10-batches-py"
    (folder / "data_batch_3").write_bytes((folder / "data_batch_3").read_bytes()[:100])  # truncated
    with pytest.raises(UsageError, match=r"data_batch_3 is corrupt or unreadable .*--data.download"):
        load_cifar10(root, train=True)
    (folder / "data_batch_3").unlink()
    with pytest.raises(UsageError, match=r"incomplete \(missing data_batch_3"):
        load_cifar10(root, train=True)
    os.mkfifo(folder / "data_batch_3")  # there, but not a file: named as what it is, not as missing
    with pytest.raises(UsageError, match=r"data_batch_3 is a FIFO, not a regular file; put the archive's file there"):
        load_cifar10(root, train=True)


def test_download_failure_is_a_usage_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def offline(*args: object, **kwargs: object) -> None:
        raise urllib.error.URLError("Name or service not known")

    monkeypatch.setattr("trainlab.data.cifar.download_and_extract_archive", offline)
    with pytest.raises(UsageError, match=r"^could not download CIFAR-10 into .*URLError.*check the network") as info:
        load_cifar10(tmp_path, train=True, download=True)
    assert "\n" not in str(info.value)


def test_download_is_skipped_when_files_exist(fake_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError("must not download")

    monkeypatch.setattr("trainlab.data.cifar.download_and_extract_archive", fail)
    assert len(load_cifar10(fake_root, train=False, download=True)) == 30


def test_checksum_verification_rejects_fake_data(fake_root: Path) -> None:
    with pytest.raises(UsageError, match="official md5"):
        load_cifar10(fake_root, train=True, verify_checksums=True)


def test_pad_crop_flip_draws_are_a_pure_function() -> None:
    assert pad_crop_flip_draws(0, 3, 17) == pad_crop_flip_draws(0, 3, 17)
    draws = [pad_crop_flip_draws(0, epoch, index) for epoch in range(4) for index in range(200)]
    tops, lefts, flips = zip(*draws)
    assert set(tops) == set(range(9)) and set(lefts) == set(range(9))
    assert 0.4 < np.mean(flips) < 0.6
    # different epochs / indices / seeds give different draws (most of the time: 162 outcomes)
    assert sum(pad_crop_flip_draws(0, 0, i) != pad_crop_flip_draws(0, 1, i) for i in range(100)) > 90
    assert sum(pad_crop_flip_draws(0, 0, i) != pad_crop_flip_draws(1, 0, i) for i in range(100)) > 90


def test_pad_crop_flip_matches_torchvision() -> None:
    img_3HW = torch.randint(0, 256, (3, 32, 32), dtype=torch.uint8)
    for top, left, flip in [(0, 0, False), (8, 8, True), (3, 6, True), (4, 4, False)]:
        expected = TF.crop(TF.pad(img_3HW, [4]), top, left, 32, 32)
        if flip:
            expected = TF.horizontal_flip(expected)
        assert torch.equal(pad_crop_flip(img_3HW, top, left, flip), expected)
    assert torch.equal(pad_crop_flip(img_3HW, 4, 4, False), img_3HW)  # centre crop, no flip = identity


def test_eval_dataset_is_plain_normalisation(fake_root: Path) -> None:
    raw = load_cifar10(fake_root, train=False)
    ds = CifarAugmentDataset.from_cifar10(raw, augment=False)
    x_3HW, label = ds[5]["image"], ds[5]["label"]
    expected = TF.normalize(
        TF.to_dtype(torch.from_numpy(raw.data[5]).permute(2, 0, 1), torch.float32, scale=True),
        list(CIFAR10_MEAN),
        list(CIFAR10_STD),
    )
    assert x_3HW.dtype == torch.float32 and x_3HW.shape == (3, 32, 32)
    torch.testing.assert_close(x_3HW, expected, rtol=0, atol=1e-6)
    assert label.dtype == torch.int64 and int(label) == raw.targets[5]


def test_augmentation_depends_only_on_seed_epoch_index(fake_root: Path) -> None:
    raw = load_cifar10(fake_root, train=True)
    a = CifarAugmentDataset.from_cifar10(raw, augment=True, seed=7)
    b = CifarAugmentDataset.from_cifar10(raw, augment=True, seed=7)
    torch.manual_seed(123)  # global RNG state must not matter
    a.set_epoch(2)
    x_a = torch.stack([a[i]["image"] for i in range(20)])
    b.set_epoch(5)
    _ = [b[i] for i in range(20)]  # a different history
    torch.manual_seed(999)
    b.set_epoch(2)
    x_b = torch.stack([b[i]["image"] for i in reversed(range(20))]).flip(0)
    assert torch.equal(x_a, x_b)
    a.set_epoch(3)
    x_next = torch.stack([a[i]["image"] for i in range(20)])
    assert sum(not torch.equal(x_a[i], x_next[i]) for i in range(20)) >= 15
    assert not torch.equal(a[0]["image"], a[1]["image"])
    c = CifarAugmentDataset.from_cifar10(raw, augment=True, seed=8)
    c.set_epoch(2)
    assert sum(not torch.equal(x_a[i], c[i]["image"]) for i in range(20)) >= 15


def _epochs(ds: CifarAugmentDataset, **loader_kwargs: object) -> list[torch.Tensor]:
    loader = DataLoader(ds, batch_size=16, shuffle=False, **loader_kwargs)  # type: ignore[arg-type]
    out = []
    for epoch in (0, 1):
        ds.set_epoch(epoch)
        out.append(torch.cat([batch["image"] for batch in loader]))
    return out


def test_same_pixels_with_zero_or_two_workers(fake_root: Path) -> None:
    ds = CifarAugmentDataset.from_cifar10(load_cifar10(fake_root, train=True), augment=True, seed=3)
    in_process = _epochs(ds, num_workers=0)
    assert not torch.equal(in_process[0], in_process[1])
    assert torch.equal(_epochs(ds, num_workers=2)[1], in_process[1])
    # persistent workers keep their dataset copy across epochs: set_epoch must still reach them
    persistent = _epochs(ds, num_workers=2, persistent_workers=True)
    assert torch.equal(persistent[0], in_process[0])
    assert torch.equal(persistent[1], in_process[1])


def test_fake_data_is_learnable(fake_root: Path) -> None:
    torch.manual_seed(0)
    raw_train, raw_test = load_cifar10(fake_root, train=True), load_cifar10(fake_root, train=False)
    train = CifarAugmentDataset.from_cifar10(raw_train, augment=True, seed=0)
    test = CifarAugmentDataset.from_cifar10(raw_test, augment=False)
    model = create_model("cifar_vgg_debug")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for epoch in range(4):
        train.set_epoch(epoch)
        for batch in DataLoader(train, batch_size=20, shuffle=True):
            x_B3HW, y_B = batch["image"], batch["label"]
            loss = torch.nn.functional.cross_entropy(model(x_B3HW), y_B)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    model.eval()
    batch = next(iter(DataLoader(test, batch_size=len(test))))
    x_B3HW, y_B = batch["image"], batch["label"]
    with torch.no_grad():
        accuracy = (model(x_B3HW).argmax(-1) == y_B).float().mean().item()
    assert accuracy > 0.3, f"accuracy {accuracy:.2f} is not clearly above chance (0.10)"
