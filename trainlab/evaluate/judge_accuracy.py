"""Classifier-judged accuracy of a labelled image set: the demo's digit judge against the labels in the file names.

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

from trainlab.demo.judge import DigitJudge, predict
from trainlab.errors import UsageError
from trainlab.evaluate.image_sets import ImageSet


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
