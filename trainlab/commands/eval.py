"""`trainlab eval knn|linear-probe --checkpoint CKPT ...`: evaluate a MoCo v3 backbone (trainlab run or official).

trainlab eval knn --checkpoint runs/moco/ckpt/last.pt --data digits --image-size 16
trainlab eval knn --checkpoint '' --arch resnet_debug --data digits      (random-init baseline)
trainlab eval knn --features pixels --data digits                        (raw-pixel baseline)
trainlab eval linear-probe --checkpoint checkpoint_0099.pth.tar --data cifar10 --image-size 32
trainlab eval linear-probe --checkpoint CKPT --data image_folder --data-root /data/imagenet --image-size 224
    (<root>/train/<class>/*, <root>/val/<class>/*: train RandomResizedCrop + flip, eval Resize + CenterCrop)
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Literal

import torch

from trainlab.config import option, parse
from trainlab.errors import UsageError
from trainlab.models.moco import MocoArch
from trainlab.recipes.moco import SslData


@dataclasses.dataclass(kw_only=True)
class KnnConfig:
    """Weighted kNN accuracy (cosine, k=200, T=0.1) of backbone features: held-out images against the train split."""

    checkpoint: str = option("", "MoCo checkpoint (official main_moco.py or trainlab ckpt/last.pt); '': random init")
    features: Literal["backbone", "pixels"] = option("backbone", "backbone features, or raw pixels (baseline)")
    arch: MocoArch = option("resnet_debug", "backbone when --checkpoint is '' (the random-init baseline)")
    data: SslData = option("digits", "digits, cifar10 or image-folder (data_root/train, data_root/val)")
    data_root: Path = option(Path("data/cifar10"), "cifar10: folder with cifar-10-batches-py/; image-folder: root")
    image_size: int = option(16, "input side (the pretraining size)")
    k: int = option(200, "neighbours")
    temperature: float = option(0.1, "temperature of the exp(similarity / T) vote")
    subset: int = option(0, "N > 0: first N images of each split")
    seed: int = option(0, "seed of the random init and of the digits split")
    device: str = option("cpu", "cpu or cuda")
    batch_size: int = option(256, "feature-extraction batch size")


def _knn(argv: list[str]) -> int:
    from trainlab.recipes.linear_probe import load_backbone
    from trainlab.recipes.moco import knn_of_features, load_eval_images

    c = parse(KnnConfig, argv, prog="trainlab eval knn")
    torch.manual_seed(c.seed)
    device = torch.device(c.device)
    images = load_eval_images(c.data, c.data_root, c.image_size, c.seed, c.subset)
    features: Callable[[torch.Tensor], torch.Tensor]
    if c.features == "pixels":
        source = "raw pixels"
        features = partial(torch.flatten, start_dim=1)
    else:
        model, source = load_backbone(c.checkpoint, c.arch, c.image_size)
        model = model.to(device).eval()
        features = model.features
    acc = knn_of_features(features, images, device=device, batch_size=c.batch_size, k=c.k, temperature=c.temperature)
    print(
        json.dumps(
            {
                "knn_accuracy": acc,
                "features": source,
                "k": c.k,
                "temperature": c.temperature,
                "bank": int(images.bank_N3HW.shape[0]),
                "queries": int(images.query_N3HW.shape[0]),
            }
        )
    )
    return 0


def _linear_probe(argv: list[str]) -> int:
    from trainlab.engine.loop import Trainer
    from trainlab.recipes.linear_probe import LinearProbeConfig, LinearProbeRecipe

    c = parse(LinearProbeConfig, argv, prog="trainlab eval linear-probe")
    recipe = LinearProbeRecipe(c)
    Trainer(recipe).fit()
    rows = [json.loads(line) for line in (Path(c.run_dir) / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if r["kind"] == "eval"]
    final = evals[-1]["test_accuracy"]
    best = max(r["test_accuracy"] for r in evals)
    print(
        json.dumps(
            {
                "final_test_accuracy": final,
                "best_epoch_test_accuracy (chosen on the test set)": best,
                "backbone": recipe.source,
            }
        )
    )
    return 0


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    mode, rest = argv[0], argv[1:]
    if mode == "knn":
        return _knn(rest)
    if mode == "linear-probe":
        return _linear_probe(rest)
    raise UsageError(f"unknown evaluation {mode!r}; choose knn or linear-probe")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
