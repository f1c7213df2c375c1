"""CPU images/s of `trainlab train moco` next to a plain loop of the official MoCo v3 algorithm on the same model
(interleaved round by round in one run, so machine load hits both alike).

    .venv/bin/python benchmarks/bench_moco.py --label sharedmachine          # both cases, JSON result in results/
    .venv/bin/python benchmarks/bench_moco.py --case vit_debug --repeats 1 --json ''   # smoke run

Cases (bundled digits, fp32, the official heads; `--steps` optimizer steps per epoch, `--epochs` epochs):
  vit_debug       trainlab's debug ViT (4x4 patches, 16 px), projector / predictor 64 / 256 wide, AdamW, B=64.
  resnet18_cifar  ResNet-18 with the CIFAR stem at 32 px (digits upscaled), the official heads 256 / 4096, LARS,
                  B=16.
Variants:
  command   THE NUMBER FOR THE RECIPE: the real `trainlab train moco` command in a subprocess (`--num-workers 0`,
            no TensorBoard, no progress bar); images/s is the `images_per_second` of the `summary` row of its
            metrics.jsonl (the engine times the training epochs only, excluding epoch 1 and the kNN evaluation).
  official  in process, main_moco.py's loop: per iteration `adjust_learning_rate` (warm-up then cosine),
            `adjust_moco_momentum`, `loss = model(x1, x2, m)` (queries, momentum update, keys), `zero_grad`,
            `backward`, `step`; the same `MoCo` module and optimizer class, the same two-view dataset through a
            plain DataLoader (shuffle, drop_last, no workers). images/s over epochs 2.. (the same definition).
Every round runs both variants of a case, alternating which goes first; medians over `--repeats` rounds.
"""

# Legend: none (no tensors are named here beyond batches of views).

from __future__ import annotations

import argparse
import math
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from _env import environment, result_path, run_metrics, settings, write_result
from torch.utils.data import DataLoader

from trainlab.data.config import DataConfig
from trainlab.data.sources import open_split
from trainlab.data.transforms import HALF, TwoViews
from trainlab.models.moco import MoCo
from trainlab.optim import LARS
from trainlab.optim.momentum import cosine_momentum


@dataclass(frozen=True)
class Case:
    arch: str
    image_size: int
    batch: int
    dim: int
    mlp_dim: int
    optimizer: str
    base_lr: float
    weight_decay: float
    temperature: float


CASES = {
    "vit_debug": Case("moco_vit_debug", 16, 64, 64, 256, "adamw", 1.5e-4, 0.1, 0.2),
    "resnet18_cifar": Case("tv_resnet18_cifar", 32, 16, 256, 4096, "lars", 0.3, 1e-6, 0.2),
}
WARMUP_FRACTION = 0.1


def command_argv(case: Case, args: argparse.Namespace, run_dir: Path) -> list[str]:
    flags: dict[str, object] = {
        "--model": case.arch,
        "--data.kind": "digits",
        "--image-size": case.image_size,
        "--data.train-limit": case.batch * args.steps,
        "--batch-size": case.batch,
        "--epochs": args.epochs,
        "--projection-dim": case.dim,
        "--mlp-hidden-dim": case.mlp_dim,
        "--optim.name": case.optimizer,
        "--optim.base-learning-rate": case.base_lr,
        "--optim.weight-decay": case.weight_decay,
        "--temperature": case.temperature,
        "--crop-min": 0.2,
        "--blur": False,
        "--schedule.warmup-fraction": WARMUP_FRACTION,
        "--eval-every-epochs": 1000,  # the final evaluation still runs (untimed): keep it small
        "--data.eval-limit": 256,
        "--knn-k": 20,
        "--device": "cpu",
        "--precision": "fp32",
        "--num-workers": 0,
        "--tensorboard": False,
        "--progress": False,
        "--seed": 0,
        "--run-dir": run_dir,
    }
    out = [sys.executable, "-m", "trainlab", "train", "moco"]
    for flag, value in flags.items():
        out += [flag, str(value).lower() if isinstance(value, bool) else str(value)]
    return out


def run_command(case: Case, args: argparse.Namespace, work: Path, index: int) -> dict[str, Any]:
    run_dir = work / f"{case.arch}_{index}"
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    t0 = time.perf_counter()
    proc = subprocess.run(command_argv(case, args, run_dir), env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(
            f"trainlab train moco failed ({proc.returncode}):\n" + "\n".join(proc.stderr.splitlines()[-15:])
        )
    _, summary = run_metrics(run_dir)
    shutil.rmtree(run_dir)
    return {"images_per_second": summary["images_per_second"], "epochs_timed": summary["epochs_timed"], "wall_s": wall}


def run_official(case: Case, args: argparse.Namespace) -> dict[str, Any]:
    """main_moco.py's training loop on the same model, data and optimizer class; images/s over epochs 2.."""
    torch.manual_seed(0)
    model = MoCo(
        case.arch, dim=case.dim, mlp_dim=case.mlp_dim, temperature=case.temperature, image_size=case.image_size
    )  # type: ignore[arg-type]
    lr = case.base_lr * case.batch / 256
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer: torch.optim.Optimizer
    if case.optimizer == "lars":
        optimizer = LARS(params, lr, weight_decay=case.weight_decay, momentum=0.9)
    else:
        optimizer = torch.optim.AdamW(params, lr, weight_decay=case.weight_decay)
    n = case.batch * args.steps
    spec = TwoViews(image_size=case.image_size, crop_min=0.2, blur=False, mean=HALF, std=HALF)
    split = open_split(DataConfig(kind="digits", train_limit=n), "train", spec, seed=0)
    assert split is not None
    dataset = split.images
    loader = DataLoader(dataset, batch_size=case.batch, shuffle=True, drop_last=True, num_workers=0)
    total = args.epochs * args.steps
    warmup = WARMUP_FRACTION * args.epochs
    epoch_seconds = []
    model.train()
    for epoch in range(args.epochs):
        dataset.set_epoch(epoch)
        t0 = time.perf_counter()
        for i, batch in enumerate(loader):
            it = epoch * args.steps + i
            e = epoch + i / args.steps  # official adjust_learning_rate: epoch + i / iters_per_epoch
            factor = (
                e / warmup if e < warmup else 0.5 * (1.0 + math.cos(math.pi * (e - warmup) / (args.epochs - warmup)))
            )
            for group in optimizer.param_groups:
                group["lr"] = lr * factor
            m = cosine_momentum(it, total, 0.99)
            loss = model(batch["view1"], batch["view2"], m)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        epoch_seconds.append(time.perf_counter() - t0)
    timed = epoch_seconds[1:]
    return {
        "images_per_second": n / (sum(timed) / len(timed)),
        "epochs_timed": len(timed),
        "last_loss": float(loss.detach()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=[*CASES, "all"], default="all")
    parser.add_argument("--repeats", type=int, default=3, help="rounds per case")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per epoch")
    parser.add_argument("--epochs", type=int, default=3, help="epochs per run (the first is not timed)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (both variants)")
    parser.add_argument("--label", default="", help="what differed about this run (goes into the file name)")
    parser.add_argument("--json", default="auto", help="result path; 'auto' = results/moco_cpu_<label>_<time>.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    env = environment()
    cases = list(CASES) if args.case == "all" else [args.case]
    work = Path(tempfile.mkdtemp(prefix="bench_moco_"))
    report: dict[str, Any] = {}
    try:
        for name in cases:
            case = CASES[name]
            shown = shlex.join(["trainlab", *command_argv(case, args, Path("$RUN"))[3:]])
            print(f"== {name}: {shown}", flush=True)
            rounds: dict[str, list[dict[str, Any]]] = {"command": [], "official": []}
            for r in range(args.repeats):
                order = ["command", "official"] if r % 2 == 0 else ["official", "command"]
                for variant in order:
                    res = run_command(case, args, work, r) if variant == "command" else run_official(case, args)
                    rounds[variant].append(res)
                    print(f"  round {r} {variant:8s} {res['images_per_second']:8.1f} images/s", flush=True)
            med = {v: statistics.median(x["images_per_second"] for x in rs) for v, rs in rounds.items()}
            report[name] = {
                "command_line": shown,
                "rounds": rounds,
                "median_images_per_second": med,
                "ratio_command_over_official": med["command"] / med["official"],
            }
            print(
                f"  median: command {med['command']:.1f}, official loop {med['official']:.1f} images/s, "
                f"ratio {med['command'] / med['official']:.3f}",
                flush=True,
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    env["load_average_1min_end"] = round(os.getloadavg()[0], 2)
    write_result(
        result_path(args.json, "moco_cpu", args.label),
        {"settings": settings(args), "cases": report, "environment": env},
    )


if __name__ == "__main__":
    main()
