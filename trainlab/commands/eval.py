"""`trainlab eval knn|linear-probe|fid|judge`: evaluate a MoCo v3 backbone, or put numbers on generated samples.

MoCo v3 backbones (trainlab run or official):
trainlab eval knn --moco-weights runs/moco/ckpt/last.pt --data.kind digits --image-size 16
trainlab eval knn --moco-weights '' --model tv_resnet_debug --data.kind digits  (random-init baseline)
trainlab eval knn --features pixels --data.kind digits                          (raw-pixel baseline)
trainlab eval linear-probe --moco-weights checkpoint_0099.pth.tar --data.kind cifar10 --image-size 32
trainlab eval linear-probe --moco-weights CKPT --data.kind image-folder --data.root /data/imagenet --image-size 224
    (<root>/train/<class>/*, <root>/val/<class>/*: train RandomResizedCrop + flip, eval Resize + CenterCrop)
--data.kind, --data.root and --image-size default to what the checkpoint was pretrained with (a trainlab run records
them, an official ViT's position table fixes its side), else digits at 16 px; a value given that differs is used,
with a warning. --data.eval-limit N caps the images of each split (kNN: bank and queries; linear-probe: the test
images, --data.train-limit the training ones). `eval linear-probe` is `trainlab train linear-probe` (the same flags,
run directory, resume and --debug) printing the test accuracy after the last epoch; stopped earlier (--max-steps,
SIGTERM), it says so (the same command resumes); a finished run launched again prints its result again.

Generated samples (a folder of PNGs or an .npz with uint8 (N, H, W, 3) under arr_0, e.g. `trainlab sample --out-dir`):
trainlab eval fid --samples samples/ --reference VIRTUAL_imagenet256_labeled.npz --inception-weights inception.pth
    FID, Inception Score, precision/recall through torch-fidelity, Inception weights from the local file only; the
    reference's statistics are cached next to it (REF.fidelity-cache/); see trainlab/evaluate/fidelity.py
trainlab eval judge --samples samples/ --judge-weights runs/demo/judge.safetensors
    the digit judge's accuracy against the labels in the file names (NNNNNN_cCCCC.png), overall and per class
Each prints one JSON line.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from trainlab.config import option, parse
from trainlab.data.config import check_image_size, eval_limit_option
from trainlab.engine.device import DEVICE_HELP
from trainlab.errors import UsageError
from trainlab.json_out import dumps_json
from trainlab.models.backbones.vit import check_vit_image_size
from trainlab.models.names import FORMER_MOCO_BACKBONES, MocoBackbone
from trainlab.recipes.linear_probe import DEFAULT_IMAGE_SIZE, DEFAULT_KIND, ProbeData
from trainlab.recipes.moco import check_knn_k


@dataclasses.dataclass(kw_only=True)
class KnnData(ProbeData):
    """The images of a kNN evaluation: the training split is the bank, the held-out split the queries."""

    eval_limit: int = eval_limit_option(
        0, "images each in the bank (training split) and the queries (held-out split)", deprecated=("--subset",)
    )

    def validate(self) -> None:
        super().validate()
        if self.train_limit:
            raise UsageError("--data.train-limit: a kNN evaluation trains nothing; --data.eval-limit caps the bank")


if TYPE_CHECKING:
    import torch

    from trainlab.engine.loop import FitResult
    from trainlab.engine.recipe import Recipe


@dataclasses.dataclass(kw_only=True)
class KnnConfig:
    """Weighted kNN accuracy (cosine, k=200, T=0.1) of backbone features: held-out images against the train split."""

    moco_weights: str = option(
        "",
        "MoCo weights: an official main_moco.py checkpoint or a trainlab run's ckpt/last.pt; '': random init",
        metavar="PATH",
        deprecated=("--checkpoint",),
    )
    features: Literal["backbone", "pixels"] = option("backbone", "backbone features, or raw pixels (baseline)")
    model: MocoBackbone = option(
        "tv_resnet_debug",
        "backbone (registry name) when --moco-weights is '' (the random-init baseline)",
        deprecated=("--arch",),
        deprecated_values=FORMER_MOCO_BACKBONES,
    )
    data: KnnData = option(KnnData(), "which images (default: the backbone's pretraining data)")
    image_size: int | None = option(None, "input side; default: the checkpoint's pretraining side, else 16", ge=1)
    k: int = option(200, "neighbours", ge=1)
    temperature: float = option(
        0.1, "temperature of the exp(similarity / T) vote (below 0.02 it overflows float32)", ge=0.02
    )
    seed: int = option(0, "seed of the random init", ge=0, lt=2**63)
    device: str = option("auto", DEVICE_HELP)
    batch_size: int = option(256, "feature-extraction batch size", ge=1)

    def validate(self) -> None:
        # what is known before a checkpoint is read: the given values, or the defaults where none will be read
        from_checkpoint = self.features == "backbone" and bool(self.moco_weights)
        kind = self.data.kind or (None if from_checkpoint else DEFAULT_KIND)
        size = self.image_size or (None if from_checkpoint else DEFAULT_IMAGE_SIZE)
        if size is not None:
            check_image_size(kind, size)
            if self.features == "backbone" and not self.moco_weights:  # a random-init backbone of --model
                check_vit_image_size(self.model, size)
        check_knn_k(self.k, "--k", kind, self.data.eval_limit)


def _knn(argv: list[str]) -> int:
    import torch

    from trainlab.data.sources import eval_images
    from trainlab.engine.device import resolve_device
    from trainlab.recipes.linear_probe import load_backbone, resolve_eval_data
    from trainlab.recipes.moco import knn_of_features

    c = parse(KnnConfig, argv, prog="trainlab eval knn")
    torch.manual_seed(c.seed)
    device = resolve_device(c.device)
    checkpoint = c.moco_weights if c.features == "backbone" else ""
    data, side = resolve_eval_data(checkpoint, c.data, c.image_size)
    check_knn_k(c.k, "--k", data.kind, data.eval_limit)  # the kind may have come from the checkpoint
    images = eval_images(data.resolved(), side)
    features: Callable[[torch.Tensor], torch.Tensor]
    if c.features == "pixels":
        source = "raw pixels"
        features = partial(torch.flatten, start_dim=1)
    else:
        model, source = load_backbone(c.moco_weights, c.model, side)
        model = model.to(device).eval()
        features = model.features
    acc = knn_of_features(
        features, images, device=device, batch_size=c.batch_size, k=c.k, temperature=c.temperature, k_flag="--k"
    )
    print(
        dumps_json(
            {
                "knn_accuracy": acc,
                "features": source,
                "k": c.k,
                "temperature": c.temperature,
                "bank": int(images.bank_N3HW.shape[0]),
                "queries": int(images.query_N3HW.shape[0]),
                "data": data.kind,
                "image_size": side,
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
        dumps_json(
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
    device: str = option("auto", DEVICE_HELP)
    batch_size: int = option(64, "images per Inception forward pass", metavar="B", ge=1)
    decode_workers: bool = option(True, "decode images in torch-fidelity's DataLoader workers (false: in-process)")
    isc_splits: int = option(
        10, "Inception Score splits (OpenAI's evaluator: 10 for 50,000 samples)", metavar="N", ge=1
    )
    prc_neighborhood: int = option(3, "k of precision/recall's k-NN manifolds", metavar="K", ge=1)


@dataclasses.dataclass(kw_only=True)
class JudgeConfig:
    """The digit judge's accuracy on a labelled sample folder (labels from NNNNNN_cCCCC.png names)."""

    samples: Path = option(
        help="labelled images: a folder of NNNNNN_cCCCC.png, or an .npz (arr_0, arr_1)", metavar="DIR|NPZ"
    )
    judge_weights: Path = option(
        help="a digit judge (trainlab train judge), e.g. runs/demo/judge.safetensors",
        metavar="PATH",
        deprecated=("--judge",),
    )
    device: str = option("auto", DEVICE_HELP)


def _fid(argv: list[str]) -> int:
    from trainlab.engine.device import resolve_device
    from trainlab.evaluate.fidelity import (
        compare_image_sets,
        file_sha256,
        load_metric_inception,
        read_reference_mu_sigma,
    )
    from trainlab.evaluate.image_sets import read_image_set

    c = parse(FidConfig, argv, prog="trainlab eval fid")
    device = resolve_device(c.device)
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
    print(dumps_json({**dataclasses.asdict(report), "samples": str(c.samples), "reference": str(c.reference)}))
    return 0


def _judge(argv: list[str]) -> int:
    from trainlab.engine.device import resolve_device
    from trainlab.evaluate.image_sets import read_image_set
    from trainlab.evaluate.judge_accuracy import judged_accuracy
    from trainlab.models.digit_judge import load_judge

    c = parse(JudgeConfig, argv, prog="trainlab eval judge")
    judge = load_judge(c.judge_weights, device=resolve_device(c.device))
    result = judged_accuracy(judge, read_image_set(c.samples, flag="--samples"))
    per_class = {str(k): {"images": n, "accuracy": acc} for k, (n, acc) in result.per_class.items()}
    print(dumps_json({"judged_accuracy": result.accuracy, "images": result.num_images, "per_class": per_class}))
    return 0


def main(argv: list[str]) -> int:
    if not argv:
        raise UsageError("name an evaluation: knn, linear-probe, fid or judge; `trainlab eval --help` describes them")
    if argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
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
