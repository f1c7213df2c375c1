"""The synthetic images (`trainlab.data.synthetic`) of data kind `fake` in the exact on-disk layout of the official
CIFAR-10 python release.

Used by the CIFAR recipe (`--data.kind fake`), tests and benchmarks so they go through the real loader
(`trainlab.data.cifar.load_cifar10`) without the 163 MB download: 32 px, 10 classes.

Layout (what `load_cifar10` and torchvision's `CIFAR10` read): `<root>/cifar-10-batches-py/` with `data_batch_1` ..
`data_batch_5`, `test_batch` and `batches.meta`, each a pickled dict. Batches hold "data" (uint8 (n, 3072), each row
the red, then green, then blue 32x32 plane), "labels" (list of int), "batch_label" (str) and "filenames" (list of
str); the meta file holds "label_names", "num_cases_per_batch" and "num_vis". The official files were pickled by
Python 2, whose `str` keys come back as `str` under `encoding="latin1"` (and as b"data" etc. only under
`encoding="bytes"`); the readers index `entry["data"]`, so the keys here are `str`. The files are written at pickle
protocol 2, where Python 3 pickles the arrays' bytes as `_codecs.encode(text, "latin1")`: `load_cifar10`'s restricted
unpickler admits exactly that.
"""

# Shape legend: N images, H/W height/width (32), 3 RGB channels.

from __future__ import annotations

import os
import pickle
import shutil
import tempfile
from pathlib import Path

import numpy as np

from trainlab.data.cifar import CIFAR10_DIRNAME
from trainlab.data.synthetic import synthetic_splits
from trainlab.errors import UsageError

CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
_NUM_TRAIN_BATCHES = 5


def _write_batch(path: Path, img_N3HW: np.ndarray, labels_N: np.ndarray, batch_label: str, first_index: int) -> None:
    entry = {
        "batch_label": batch_label,
        "labels": [int(y) for y in labels_N],
        "data": img_N3HW.reshape(len(img_N3HW), 3 * 32 * 32),
        "filenames": [f"fake_{first_index + i:06d}.png" for i in range(len(labels_N))],
    }
    with open(path, "wb") as f:
        pickle.dump(entry, f, protocol=2)


def write_fake_cifar10(root: str | Path, *, num_train: int = 256, num_test: int = 64, seed: int = 0) -> Path:
    """Writes a small synthetic CIFAR-10 that `load_cifar10` (and torchvision's `CIFAR10`) can open.

    Args:
        root: directory to create `cifar-10-batches-py/` in (existing files there are overwritten). The set is
            written to a hidden temp folder and renamed into place, so a killed generation leaves no half set and
            concurrent writers (torchrun ranks) are safe.
        num_train: training images, spread over the five `data_batch_*` files (classes balanced).
        num_test: test images in `test_batch` (classes balanced, drawn after the training set).
        seed: the synthetic set's stream (`synthetic_splits`): the same arguments write the same bytes.

    Returns:
        `root` as a Path: the value to pass as `load_cifar10(root, ...)` / `--data.root`.

    Raises:
        UsageError: if `num_train` or `num_test` is not positive.
    """
    if num_train <= 0 or num_test <= 0:
        raise UsageError(f"fake CIFAR-10 needs at least one train and one test image, got {num_train} / {num_test}")
    root = Path(root).expanduser()
    target = root / CIFAR10_DIRNAME
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(f".{CIFAR10_DIRNAME}.*.tmp"):  # a generation killed half-way (its process is gone)
        if not _alive(stale.name.split(".")[2]):
            shutil.rmtree(stale, ignore_errors=True)
    folder = Path(tempfile.mkdtemp(prefix=f".{CIFAR10_DIRNAME}.{os.getpid()}.", suffix=".tmp", dir=root))
    train, test = synthetic_splits(num_train, num_test, image_size=32, num_classes=len(CIFAR10_CLASSES), seed=seed)
    train_img_N3HW, train_labels_N = train.images_N3SS, train.labels_N
    bounds = np.linspace(0, num_train, _NUM_TRAIN_BATCHES + 1).astype(int)
    for b in range(_NUM_TRAIN_BATCHES):
        lo, hi = bounds[b], bounds[b + 1]
        label = f"training batch {b + 1} of {_NUM_TRAIN_BATCHES}"
        _write_batch(folder / f"data_batch_{b + 1}", train_img_N3HW[lo:hi], train_labels_N[lo:hi], label, lo)

    _write_batch(folder / "test_batch", test.images_N3SS, test.labels_N, "testing batch 1 of 1", 0)

    meta = {"num_cases_per_batch": int(bounds[1] - bounds[0]), "label_names": list(CIFAR10_CLASSES), "num_vis": 3072}
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump(meta, f, protocol=2)
    if target.exists():  # overwrite: move the old set aside first, so the rename below commits the new one
        old = Path(tempfile.mkdtemp(prefix=f".{CIFAR10_DIRNAME}.{os.getpid()}.", suffix=".tmp", dir=root))
        os.replace(target, old / CIFAR10_DIRNAME)
        shutil.rmtree(old, ignore_errors=True)
    try:  # the rename is the commit point: processes racing here (torchrun ranks) write the same files; one wins
        os.rename(folder, target)
    except OSError:
        shutil.rmtree(folder, ignore_errors=True)
        if not (target / "batches.meta").is_file():
            raise
    return root


def _alive(pid_text: str) -> bool:
    """Whether the process whose pid is in a temp folder's name still runs (unparsable: assume it does)."""
    try:
        os.kill(int(pid_text), 0)
    except ValueError:
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
