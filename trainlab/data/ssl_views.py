"""Datasets of MoCo v3's two asymmetric views (`trainlab.data.transforms.two_views`) of in-memory images or an
image folder: samples `{"view1": (3, S, S), "view2": (3, S, S), "label": int64}`.

The views of sample i in epoch e are a pure function of (seed, e, i) (see `two_views`), so resumed runs and any
number of loader workers see the same views.

With `TwoViews.deferred` (MoCo's `--augment-device cuda`) a sample stops after the crops: `{"view1": (3, S, S)
crop on the image's pixels, "view1_draws": (P,) float64, "view2", "view2_draws", "label"}`, finished on the batch's
device by `trainlab.data.batch_views.adjust_views` with the same draws.

Shape legend: C channels (3), H/W pixels, S output side, N images.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from pathlib import Path

import torch
from torch.utils.data import Dataset

from trainlab.data.augment import EpochCounter
from trainlab.data.image_folder import FolderIndex, UnreadableSkipper, evenly_spaced, scan_image_folder
from trainlab.data.transforms import TwoViews, two_view_crops, two_views

log = logging.getLogger(__name__)


class TwoViewDataset(Dataset[dict[str, torch.Tensor]], ABC):
    """Images as `{"view1": (3, S, S), "view2": (3, S, S), "label": int64}` (the label only for monitoring).

    Subclasses provide `_sample(index)`: the image, (3, H, W) uint8 or in [0, 1] in the default dtype (float32),
    and its class id. Call `set_epoch` before each epoch.
    """

    def __init__(self, spec: TwoViews, *, seed: int) -> None:
        self.spec = spec
        self.seed = seed
        self._epoch = EpochCounter()

    def set_epoch(self, epoch: int) -> None:
        self._epoch.set(epoch)

    @abstractmethod
    def _sample(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample `index`: (3, H, W) uint8 or in [0, 1] in the default dtype, and its class id (int64 scalar, for
        monitoring only)."""

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        img_CHW, label = self._sample(index)
        if self.spec.deferred:  # crops and draws; `batch_views.adjust_views` finishes them on the batch's device
            crop1, draws1, crop2, draws2 = two_view_crops(
                img_CHW, self.spec, seed=self.seed, epoch=self._epoch.get(), index=index
            )
            return {"view1": crop1, "view1_draws": draws1, "view2": crop2, "view2_draws": draws2, "label": label}
        view1, view2 = two_views(img_CHW, self.spec, seed=self.seed, epoch=self._epoch.get(), index=index)
        return {"view1": view1, "view2": view2, "label": label}


class TensorTwoViews(TwoViewDataset):
    """Two views of in-memory images (digits, CIFAR-10).

    Args:
        images_N3HW: float32 in [0, 1] or uint8.
        labels_N: int64 labels.
    """

    def __init__(self, images_N3HW: torch.Tensor, labels_N: torch.Tensor, spec: TwoViews, *, seed: int) -> None:
        super().__init__(spec, seed=seed)
        self.images_N3HW = images_N3HW
        self.labels_N = labels_N.long()

    def __len__(self) -> int:
        return int(self.labels_N.shape[0])

    def _sample(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        img = self.images_N3HW[index]
        dtype = torch.get_default_dtype()
        img = img.to(dtype).div(255.0) if img.dtype == torch.uint8 else img.to(dtype)
        return img, self.labels_N[index].clone()


class FolderTwoViews(TwoViewDataset):
    """Two views of an ImageNet-layout folder (official main_moco.py: `ImageFolder(traindir, TwoCropsTransform)`).

    Scanning, reading and the skipping of unreadable images are the image folder's (`trainlab.data.image_folder`):
    an unreadable image is replaced by the next readable one, counted (`skipped_images`) and warned about; the views
    are still drawn from (seed, epoch, index) of the requested sample.
    """

    def __init__(
        self, root: str | Path, spec: TwoViews, *, seed: int, index: FolderIndex | None = None, limit: int = 0
    ) -> None:
        super().__init__(spec, seed=seed)
        self.index = index if index is not None else scan_image_folder(root)
        self.positions = evenly_spaced(len(self.index.files), limit)
        self._reader = UnreadableSkipper(self.index)

    def __len__(self) -> int:
        return len(self.positions)

    @property
    def skipped_images(self) -> int:
        """Unreadable images replaced since the last `set_epoch` (all loader workers together)."""
        return self._reader.skipped

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch of the view draws; logs and resets the previous epoch's skip count."""
        skipped = self._reader.reset()
        if skipped:
            log.warning(
                "%s: epoch %d replaced %d unreadable image(s) by the next readable one",
                self.index.root,
                self._epoch.get(),
                skipped,
            )
        super().set_epoch(epoch)

    def _sample(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        position, pixels_3HW = self._reader.read_pixels(self.positions[index])
        return pixels_3HW, torch.tensor(self.index.files[position][1], dtype=torch.long)
