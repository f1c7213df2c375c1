"""In-memory datasets that yield the engine's one batch format: a dict of named tensors per sample.

Shapes: N samples, 3/H/W image channels and side.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.data import Dataset

from trainlab.data.augment import EpochCounter, FlipMode, augment_draws, decide_flip


class NamedTensorDataset(Dataset[dict[str, torch.Tensor]]):
    """Sample i is `{name: tensor[i]}` for every named tensor (all with the same first dimension N)."""

    def __init__(self, **tensors: torch.Tensor) -> None:
        sizes = {int(t.shape[0]) for t in tensors.values()}
        if len(sizes) != 1:
            raise ValueError(f"named tensors need one common first dimension, got {sorted(sizes)}")
        self.tensors = tensors

    def __len__(self) -> int:
        return int(next(iter(self.tensors.values())).shape[0])

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {name: t[index] for name, t in self.tensors.items()}


class TensorImageDataset(Dataset[dict[str, torch.Tensor]]):
    """In-memory images (N, 3, H, W) in [-1, 1] as `{"image", "label"}` samples, with deterministic flips.

    flip "random" mirrors sample i in epoch e when a draw of (seed, e, i) is odd: the same whatever the worker
    count or resume point (call `set_epoch` before iterating, as the engine does).
    """

    def __init__(
        self, images_N3HW: torch.Tensor, labels_N: torch.Tensor, *, flip: FlipMode = "none", seed: int = 0
    ) -> None:
        self.images_N3HW, self.labels_N, self.flip, self.seed = images_N3HW, labels_N.long(), flip, seed
        self._epoch = EpochCounter()

    def set_epoch(self, epoch: int) -> None:
        """Selects the epoch of the flip draws (visible to already-started loader workers too)."""
        self._epoch.set(epoch)

    def __len__(self) -> int:
        return int(self.labels_N.shape[0])

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        img_3HW = self.images_N3HW[index]
        draws = augment_draws(self.seed, self._epoch.get(), index) if self.flip == "random" else (0, 0)
        if decide_flip(self.flip, draws):
            img_3HW = img_3HW.flip(-1)
        return {"image": img_3HW.contiguous(), "label": self.labels_N[index].clone()}


class MapImage(Dataset[dict[str, torch.Tensor]]):
    """Another dataset's samples with `fn` applied to their "image" (`set_epoch` and `skipped_images` pass on).

    `fn` must be picklable (a module-level function or a `functools.partial` of one) for loader worker processes.
    """

    def __init__(self, data: Dataset[dict[str, torch.Tensor]], fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.data, self.fn = data, fn

    def __len__(self) -> int:
        return len(self.data)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        sample = self.data[index]
        return {**sample, "image": self.fn(sample["image"])}

    def set_epoch(self, epoch: int) -> None:
        set_epoch = getattr(self.data, "set_epoch", None)
        if set_epoch is not None:
            set_epoch(epoch)

    @property
    def skipped_images(self) -> int:
        """Unreadable images the underlying dataset replaced (0 when it reads no files)."""
        return int(getattr(self.data, "skipped_images", 0))
