"""`trainlab eval knn|linear-probe|fid|judge`: evaluate a MoCo v3 backbone, or put numbers on generated samples.

MoCo v3 backbones (trainlab run or official):
trainlab eval knn --checkpoint runs/moco/ckpt/last.pt --data digits --image-size 16
trainlab eval knn --checkpoint '' --arch resnet_debug --data digits      (random-init baseline)
trainlab eval knn --features pixels --data digits                        (raw-pixel baseline)
trainlab eval linear-probe --checkpoint checkpoint_0099.pth.tar --data cifar10 --image-size 32
trainlab eval linear-probe --checkpoint CKPT --data image-folder --data-root /data/imagenet --image-size 224
    (<root>/train/<class>/*, <root>/val/<class>/*: train RandomResizedCrop + flip, eval Resize + CenterCrop)
--data, --image-size and --data-root default to what the checkpoint was pretrained with (a trainlab run records them,
an official ViT's position table fixes its side), else digits at 16 px; a value given that differs is used, with a
warning. `eval linear-probe` is `trainlab train linear-probe` (the same flags, run directory, resume and --debug)
printing the test accuracy after the last epoch; stopped earlier (--max-steps, SIGTERM), it says so (the same
command resumes); a finished run launched again prints its result again.

Generated samples (a folder of PNGs or an .npz with uint8 (N, H, W, 3) under arr_0, e.g. `trainlab sample --out-dir`):
trainlab eval fid --samples samples/ --reference VIRTUAL_imagenet256_labeled.npz --inception-weights inception.pth
    FID, Inception Score, precision/recall through torch-fidelity, Inception weights from the local file only; the
    reference's statistics are cached next to it (REF.fidelity-cache/); see trainlab/evaluate/fidelity.py
trainlab eval judge --samples samples/ --judge runs/demo/judge.safetensors
    the demo judge's accuracy against the labels in the file names (NNNNNN_cCCCC.png), overall and per class
Each prints one JSON line.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from trainlab.config import option, parse
from trainlab.errors import UsageError
from trainlab.models.moco import MocoArch
from trainlab.recipes.linear_probe import DEFAULT_DATA, DEFAULT_IMAGE_SIZE
from trainlab.recipes.moco import SslData, check_image_size, check_knn_k

if TYPE_CHECKING:
    from trainlab.engine.loop import FitResult
    from trainlab.engine.recipe import Recipe


@dataclasses.dataclass(kw_only=True)
class KnnConfig:
    """Weighted kNN accuracy (cosine, k=200, T=0.1) of backbone features: held-out images against the train split."""

    checkpoint: str = option("", "MoCo checkpoint (official main_moco.py or trainlab ckpt/last.pt); '': random init")
    features: Literal["backbone", "pixels"] = option("backbone", "backbone features, or raw pixels (baseline)")
    arch: MocoArch = option("resnet_debug", "backbone when --checkpoint is '' (the random-init baseline)")
    data: SslData | None = option(
        None, "digits, cifar10 or image-folder (data_root/train, data_root/val); default: the checkpoint's, else digits"
    )
    data_root: Path | None = option(
        None, "cifar10: folder with cifar-10-batches-py/; image-folder: root; default: the checkpoint's, else "
        "data/cifar10",
    )  # fmt: skip
    image_size: int | None = option(None, "input side; default: the checkpoint's pretraining side, else 16", ge=1)
    k: int = option(200, "neighbours", ge=1)
    temperature: float = option(
        0.1, "temperature of the exp(similarity / T) vote (below 0.02 it overflows float32)", ge=0.02
    )
    subset: int = option(0, "N > 0: first N images of each split (0: all)", ge=0)
    seed: int = option(0, "seed of the random init and of the digits split", ge=0, lt=2**63)
    device: str = option("cpu", "cpu or cuda")
    batch_size: int = option(256, "feature-extraction batch size", ge=1)

    def validate(self) -> None:
        # what is known before a checkpoint is read: the given values, or the defaults where none will be read
        from_checkpoint = self.features == "backbone" and bool(self.checkpoint)
        data = self.data or (None if from_checkpoint else DEFAULT_DATA)
        size = self.image_size or (None if from_checkpoint else DEFAULT_IMAGE_SIZE)
        random_backbone = self.features == "backbone" and not self.checkpoint
        if data is not None and size is not None:
            check_image_size(data, size, self.arch if random_backbone else None)
        if data is not None:
            check_knn_k(self.k, "--k", data, self.subset, "--subset")


def _knn(argv: list[str]) -> int:
    from trainlab.engine.loop import resolve_device
    from trainlab.recipes.linear_probe import load_backbone, resolve_eval_data
    from trainlab.recipes.moco import knn_of_features, load_eval_images

    c = parse(KnnConfig, argv, prog="trainlab eval knn")
    torch.manual_seed(c.seed)
    device = resolve_device(c.device)
    checkpoint = c.checkpoint if c.features == "backbone" else ""
    d = resolve_eval_data(checkpoint, c.data, c.image_size, c.data_root)
    check_knn_k(c.k, "--k", d.data, c.subset, "--subset")  # the data set may have come from the checkpoint
    images = load_eval_images(d.data, d.data_root, d.image_size, c.seed, c.subset)
    features: Callable[[torch.Tensor], torch.Tensor]
    if c.features == "pixels":
        source = "raw pixels"
        features = partial(torch.flatten, start_dim=1)
    else:
        model, source = load_backbone(c.checkpoint, c.arch, d.image_size)
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
                "data": d.data,
                "image_size": d.image_size,
            }
        )
    )
    return 0


def _linear_probe(argv: list[str]) -> int:
    """`trainlab eval linear-probe ...` is `trainlab train linear-probe ...` (the same flags, run, resume and --debug)
    reporting the run's final evaluation as one JSON line."""
    from trainlab.commands.train import train

    return train("linear-probe", argv, prog="trainlab eval linear-probe", report=_report_probe, interrupted_code=130)


def _report_probe(recipe: Recipe[Any], result: FitResult) -> None:
    """The test accuracy after the last epoch (`FitResult.last_eval`), or why there is none yet."""
    epochs = recipe.config.epochs
    final = result.last_eval.get("test_accuracy") if result.last_eval_epoch == epochs else None
    if final is None:
        print(
            f"trainlab eval linear-probe: no evaluation yet: training stopped at step {result.step} ({result.status}, "
            f"epoch {result.epoch} of {epochs} done) before the evaluation of the last epoch; run without "
            "--max-steps (or a larger one) to get the test accuracy",
            file=sys.stderr,
        )
    print(
        json.dumps(
            {
                "final_test_accuracy": final,
                "evaluated_after_epoch": result.last_eval_epoch,
                "step": result.step,
                "status": result.status,
                "backbone": getattr(recipe, "source", ""),
            }
        )
    )


@dataclasses.dataclass(kw_only=True)
class FidConfig:
    """FID, Inception Score and precision/recall of generated images against a reference set (torch-fidelity)."""

    samples: Path = option(help="generated images: a folder of PNGs or an .npz (arr_0)", metavar="DIR|NPZ")
    reference: Path = option(
        help="real images: a folder or an .npz (arr_0; an OpenAI-evaluator batch's mu/sigma also used)",
        metavar="DIR|NPZ",
    )
    inception_weights: Path | None = option(
        None, "torch-fidelity's pt_inception-2015-12-05 weights file (nothing is downloaded)", metavar="PATH"
    )
    feature_dims: Literal["2048", "768", "192", "64"] = option(
        "2048", "Inception features of FID and precision/recall: 2048 = standard FID; fewer for small sets"
    )
    device: Literal["auto", "cpu", "cuda"] = option("auto", "auto: cuda if available, else cpu")
    batch_size: int = option(64, "images per Inception forward pass", metavar="B", ge=1)
    decode_workers: bool = option(True, "decode images in torch-fidelity's DataLoader workers (false: in-process)")
    isc_splits: int = option(
        10, "Inception Score splits (OpenAI's evaluator: 10 for 50,000 samples)", metavar="N", ge=1
    )
    prc_neighborhood: int = option(3, "k of precision/recall's k-NN manifolds", metavar="K", ge=1)


@dataclasses.dataclass(kw_only=True)
class JudgeConfig:
    """The demo judge's accuracy on a labelled sample folder (labels from NNNNNN_cCCCC.png names)."""

    samples: Path = option(
        help="labelled images: a folder of NNNNNN_cCCCC.png, or an .npz (arr_0, arr_1)", metavar="DIR|NPZ"
    )
    judge: Path = option(help="the demo's judge, e.g. runs/demo/judge.safetensors", metavar="PATH")
    device: str = option("cpu", "cpu or cuda")


def _fid(argv: list[str]) -> int:
    from trainlab.evaluate.fidelity import (
        compare_image_sets,
        file_sha256,
        load_metric_inception,
        read_reference_mu_sigma,
    )
    from trainlab.evaluate.image_sets import read_image_set

    c = parse(FidConfig, argv, prog="trainlab eval fid")
    if c.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: CUDA is not available here; use --device cpu (or auto)")
    use_cuda = c.device == "cuda" or (c.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda" if use_cuda else "cpu")
    samples = read_image_set(c.samples, flag="--samples")
    reference = read_image_set(c.reference, flag="--reference")
    read_reference_mu_sigma(reference)  # a malformed reference batch fails before the network is loaded
    extractor = load_metric_inception(c.inception_weights, device, feature_layer=c.feature_dims)
    assert c.inception_weights is not None  # load_metric_inception refused None
    report = compare_image_sets(
        samples,
        reference,
        extractor,
        weights_sha256=file_sha256(c.inception_weights),
        feature_layer=c.feature_dims,
        batch_size=c.batch_size,
        decode_workers=c.decode_workers,
        isc_splits=c.isc_splits,
        prc_neighborhood=c.prc_neighborhood,
    )
    print(json.dumps({**dataclasses.asdict(report), "samples": str(c.samples), "reference": str(c.reference)}))
    return 0


def _judge(argv: list[str]) -> int:
    from trainlab.demo.judge import load_judge
    from trainlab.engine.loop import resolve_device
    from trainlab.evaluate.image_sets import read_image_set
    from trainlab.evaluate.judge_accuracy import judged_accuracy

    c = parse(JudgeConfig, argv, prog="trainlab eval judge")
    judge = load_judge(c.judge, device=resolve_device(c.device))
    result = judged_accuracy(judge, read_image_set(c.samples, flag="--samples"))
    per_class = {str(k): {"images": n, "accuracy": acc} for k, (n, acc) in result.per_class.items()}
    print(json.dumps({"judged_accuracy": result.accuracy, "images": result.num_images, "per_class": per_class}))
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
    if mode == "fid":
        return _fid(rest)
    if mode == "judge":
        return _judge(rest)
    raise UsageError(f"unknown evaluation {mode!r}; choose knn, linear-probe, fid or judge")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
