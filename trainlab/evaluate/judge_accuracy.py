"""Classifier-judged accuracy: the digit judge's predictions, its accuracy on labelled tensors, and on a labelled
image set against the labels in the file names.

For samples from `trainlab sample --out-dir` (names `NNNNNN_cCCCC.png`) the label is the class each image was
generated for, so the accuracy is the share of samples the judge recognises as their class: the demo's
conditional accuracy, for any folder or `.npz` (labels under `arr_1`). Pixels p in 0..255 become p / 127.5 - 1,
the judge's [-1, 1] range.
"""

# Shape legend: N images, B a batch, H/W pixels, 3 RGB channels.

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from trainlab.errors import UsageError
from trainlab.evaluate.image_sets import ImageSet
from trainlab.models.digit_judge import DigitJudge


@torch.no_grad()
def predict(judge: DigitJudge, images_N3HW: torch.Tensor, *, batch_size: int = 1000) -> torch.Tensor:
    """Predicted class ids (N,) int64 on CPU, computed on the judge's device and dtype (the judge is put in eval
    mode).

    Raises:
        UsageError: images of another shape than (N, 3, R, R) at the judge's resolution R.
    """
    expected = (3, judge.resolution, judge.resolution)
    if images_N3HW.ndim != 4 or tuple(images_N3HW.shape[1:]) != expected:
        raise UsageError(
            f"the judge takes (N, {', '.join(map(str, expected))}) images, got {tuple(images_N3HW.shape)}: "
            "resize the samples or train a judge at their resolution"
        )
    judge.eval()
    weight = next(judge.parameters())
    batches = images_N3HW.split(batch_size)
    return torch.cat([judge(img_B3HW.to(weight.device, weight.dtype)).argmax(dim=1).cpu() for img_B3HW in batches])


def accuracy(judge: DigitJudge, images_N3HW: torch.Tensor, labels_N: torch.Tensor) -> float:
    """Fraction of `images_N3HW` (in [-1, 1]) whose predicted class equals `labels_N`: for generated samples and
    the class each was conditioned on, the conditional accuracy (chance 1/K; the judge's own held-out accuracy is
    the practical ceiling).

    Raises:
        UsageError: not one label per image, or images the judge does not take.
    """
    if labels_N.shape != (images_N3HW.shape[0],):
        raise UsageError(f"need one label per image: got labels {tuple(labels_N.shape)}, images {images_N3HW.shape[0]}")
    return (predict(judge, images_N3HW) == labels_N.cpu()).float().mean().item()


@dataclasses.dataclass(frozen=True)
class JudgedAccuracy:
    """Overall and per-class accuracy; `per_class[c] = (images labelled c, share of them predicted as c)`."""

    accuracy: float
    per_class: dict[int, tuple[int, float]]
    num_images: int


def judged_accuracy(judge: DigitJudge, images: ImageSet, *, batch_size: int = 1000) -> JudgedAccuracy:
    """The judge's accuracy on `images` against their labels.

    Raises:
        UsageError: the set has no labels, a label the judge does not know, or images of another size than the
            judge's.
    """
    labels_N = images.labels_N
    if labels_N is None:
        raise UsageError(
            f"{images.source} has no class labels: name the files NNNNNN_cCCCC.png (as trainlab sample --out-dir "
            "does) or put int labels under arr_1 of the .npz"
        )
    bad = labels_N[(labels_N < 0) | (labels_N >= judge.num_classes)]
    if bad.size:
        raise UsageError(f"label {int(bad[0])} is outside the judge's classes 0..{judge.num_classes - 1}")
    height, width, _ = images.image_shape
    if (height, width) != (judge.resolution, judge.resolution):
        raise UsageError(
            f"{images.source} holds {width}x{height} images, the judge takes {judge.resolution}x{judge.resolution}: "
            "evaluate samples at the judge's resolution"
        )
    predicted: list[torch.Tensor] = []
    for start in range(0, len(images), batch_size):
        stop = min(start + batch_size, len(images))
        batch_BHW3 = np.stack([images.image(i) for i in range(start, stop)])
        img_B3HW = torch.from_numpy(batch_BHW3).permute(0, 3, 1, 2).float() / 127.5 - 1.0
        predicted.append(predict(judge, img_B3HW, batch_size=batch_size))
    correct_N = (torch.cat(predicted).numpy() == labels_N).astype(np.float64)
    per_class = {
        int(c): (int((labels_N == c).sum()), float(correct_N[labels_N == c].mean())) for c in np.unique(labels_N)
    }
    return JudgedAccuracy(accuracy=float(correct_N.mean()), per_class=per_class, num_images=len(images))
