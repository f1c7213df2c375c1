"""MoCo v3 on the bundled digits, CPU: pretrain once, then kNN (pretrained / same encoder at random init / raw
pixels), linear probes (pretrained / random init), and the figure of loss and kNN accuracy over training.

    .venv/bin/python benchmarks/moco_digits.py      # ~4 min on the shared 2-core CPU at load 2.3 (README sec. 6)
    .venv/bin/python benchmarks/moco_digits.py --json '' --figure ''  # nothing written outside --work-dir

Every number comes from the user-facing commands (`trainlab train moco`, `trainlab eval knn`, `trainlab eval
linear-probe`), run as subprocesses and timed from outside. The random-init baseline is `trainlab eval knn
--moco-weights '' --model tv_resnet_debug --seed 0`; the script checks, in process, that its backbone is
bit-identical to the backbone the training run starts from (same seed), so "random init" is this run's own starting
point.
"""

# Legend: none (no tensors are named here beyond whole state dicts).

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from _env import environment, result_path, settings, write_result

REPO = Path(__file__).resolve().parent.parent
CONFIG = "moco_v3_digits"


def run_cli(args: list[str]) -> tuple[str, float]:
    """Run `python -m trainlab ARGS`; returns (stdout, wall seconds). Raises on a non-zero exit."""
    cmd = [sys.executable, "-m", "trainlab", *args]
    print("$ trainlab " + " ".join(repr(a) if a == "" else a for a in args), flush=True)
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        sys.stderr.write(done.stdout + done.stderr)
        raise SystemExit(f"command failed ({done.returncode}): {' '.join(cmd)}")
    print(f"  ({wall:.1f} s)", flush=True)
    return done.stdout, wall


def last_json(stdout: str) -> dict[str, Any]:
    """The last line of `stdout` that parses as a JSON object (the eval commands print one)."""
    for line in reversed(stdout.strip().splitlines()):
        if line.startswith("{"):
            return dict(json.loads(line))
    raise SystemExit(f"no JSON result in:\n{stdout}")


def random_init_is_run_init(seed: int) -> bool:
    """Whether `eval knn --moco-weights ''` at `seed` builds the backbone the training run starts from."""
    from trainlab.config import from_dict, load_yaml, resolve_config
    from trainlab.engine.seeding import seed_everything
    from trainlab.recipes.linear_probe import load_backbone
    from trainlab.recipes.moco import MocoConfig, MocoRecipe

    cfg = from_dict(MocoConfig, load_yaml(resolve_config(CONFIG)))
    seed_everything(seed)
    run_model = MocoRecipe(cfg).build(torch.device("cpu")).models["moco"]
    torch.manual_seed(seed)  # what `trainlab eval knn --seed` does before building the model
    baseline, _ = load_backbone("", cfg.model, cfg.image_size)
    a = {k: v for k, v in run_model.base_encoder.state_dict().items() if not k.startswith("fc.")}
    b = {k: v for k, v in baseline.base_encoder.state_dict().items() if not k.startswith("fc.")}
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def plot(metrics: list[dict[str, Any]], random_knn: float, pixels_knn: float, out: Path) -> None:
    """Loss per logged step and kNN accuracy per epoch (epoch 0 = the random init, measured)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in metrics if r["kind"] == "train"]
    evals = [r for r in metrics if r["kind"] == "eval" and "knn_accuracy" in r]
    steps_per_epoch = evals[0]["step"] / evals[0]["epoch"]  # eval rows: "epoch" counts completed epochs
    fig, (ax_loss, ax_knn) = plt.subplots(1, 2, figsize=(10, 3.6))
    ax_loss.plot([r["step"] / steps_per_epoch for r in train], [r["loss"] for r in train], lw=1)
    ax_loss.set_xlabel("epoch")
    ax_loss.set_ylabel("symmetric InfoNCE loss (x 2T)")
    ax_loss.set_title("MoCo v3 loss, digits, tv_resnet_debug")
    epochs = [0] + [r["epoch"] for r in evals]
    accs = [100 * random_knn] + [100 * r["knn_accuracy"] for r in evals]
    ax_knn.plot(epochs, accs, marker="o", ms=3, label="pretrained encoder (epoch 0: random init)")
    ax_knn.axhline(100 * pixels_knn, color="grey", ls="--", lw=1, label="raw pixels")
    ax_knn.set_xlabel("epoch")
    ax_knn.set_ylabel("kNN accuracy, held-out digits (%)")
    ax_knn.set_title("weighted kNN (k=200, T=0.1)")
    ax_knn.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", default="runs/moco-digits-bench", help="run directories (relative: repo root)")
    parser.add_argument("--eval-every-epochs", type=int, default=1, help="kNN monitor period of the training run")
    parser.add_argument("--probe-epochs", type=int, default=90, help="linear-probe epochs (official 90)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--figure", default="docs/moco/curves.png", help="figure path ('' = none)")
    parser.add_argument("--json", default="auto", help="result path; 'auto' = results/moco_digits_<time>.json")
    args = parser.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    env = environment()
    work = Path(args.work_dir)
    pre, probe = work / "pretrain", work / "linear-probe"
    ckpt = str(pre / "ckpt" / "last.pt")

    train_args = ["train", "moco", "--config", CONFIG, "--run-dir", str(pre), "--seed", str(args.seed)]
    train_args += ["--eval-every-epochs", str(args.eval_every_epochs), "--overwrite"]
    _, train_wall = run_cli(train_args)
    knn_base = ["eval", "knn", "--data.kind", "digits", "--image-size", "16", "--seed", str(args.seed)]
    knn_pre, _ = run_cli([*knn_base, "--moco-weights", ckpt])
    knn_rand, _ = run_cli([*knn_base, "--moco-weights", "", "--model", "tv_resnet_debug"])
    knn_pix, _ = run_cli([*knn_base, "--features", "pixels"])
    probe_args = ["eval", "linear-probe", "--moco-weights", ckpt, "--run-dir", str(probe), "--overwrite"]
    probe_args += ["--epochs", str(args.probe_epochs), "--seed", str(args.seed)]
    probe_out, probe_wall = run_cli(probe_args)
    rand_probe_args = ["eval", "linear-probe", "--moco-weights", "", "--model", "tv_resnet_debug", "--run-dir"]
    rand_probe_args += [str(work / "linear-probe-random-init"), "--overwrite", "--epochs", str(args.probe_epochs)]
    rand_probe_args += ["--seed", str(args.seed)]
    rand_probe_out, _ = run_cli(rand_probe_args)

    metrics = [json.loads(line) for line in (REPO / pre / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in metrics if r["kind"] == "eval" and "knn_accuracy" in r]
    results = {
        "knn_pretrained": last_json(knn_pre),
        "knn_random_init": last_json(knn_rand),
        "knn_raw_pixels": last_json(knn_pix),
        "random_init_is_the_runs_initial_backbone": random_init_is_run_init(args.seed),
        "linear_probe": last_json(probe_out),
        "linear_probe_random_init": last_json(rand_probe_out),
        "pretrain_wall_s": round(train_wall, 1),
        "linear_probe_wall_s": round(probe_wall, 1),
        "pretrain_final_loss": [r["loss"] for r in metrics if r["kind"] == "train"][-1],
        "knn_monitor_by_epoch": {r["epoch"]: r["knn_accuracy"] for r in evals},  # epochs completed
    }
    if args.figure:
        random_acc = results["knn_random_init"]["knn_accuracy"]
        plot(metrics, random_acc, results["knn_raw_pixels"]["knn_accuracy"], REPO / args.figure)
    commands = {"train": train_args, "linear_probe": probe_args, "linear_probe_random_init": rand_probe_args}
    commands["knn"] = knn_base
    result = {"settings": settings(args), "commands": commands, "results": results, "environment": env}
    result["environment"]["load_average_1min_end"] = round(os.getloadavg()[0], 2)
    print(json.dumps(results, indent=1))
    write_result(result_path(args.json, "moco_digits", "cpu"), result)


if __name__ == "__main__":
    main()
