"""The CIFAR recipe's data group: CIFAR-10 or fake images in its file format, and the former `--fake-data N`.

Torch-free (like `trainlab.data.config`), so `trainlab bench precision`, which takes the CIFAR recipe's data group,
parses and refuses its flags without importing torch.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Literal

from trainlab.data.config import (
    DataConfig,
    download_option,
    eval_limit_option,
    fake_size_option,
    kind_option,
    root_option,
)

log = logging.getLogger(__name__)

CifarKind = Literal["cifar10", "fake"]


@dataclasses.dataclass(kw_only=True)
class CifarData(DataConfig):
    """CIFAR-10 (--data.root/cifar-10-batches-py, --data.download) or fake images in its file format."""

    kind: CifarKind = kind_option("cifar10", CifarKind)
    root: Path = root_option(Path("data/cifar10"), CifarKind, deprecated=("--data-root",))
    eval_limit: int = eval_limit_option(0, "test images")
    fake_size: int = fake_size_option()
    download: bool = download_option(deprecated=("--download",))


def upgrade_fake_data(data: CifarData, fake_data: int) -> CifarData:
    """The data group the former `--fake-data N` stands for: N > 0 is `--data.kind fake --data.fake-size N` (said in
    a warning; one former flag for two settings, so it is a field of its own until the next release), 0 nothing."""
    if fake_data <= 0:
        return data
    log.warning(
        "--fake-data %d is the former spelling of --data.kind fake --data.fake-size %d (accepted until the next "
        "release); use those",
        fake_data,
        fake_data,
    )
    return dataclasses.replace(data, kind="fake", fake_size=fake_data)
