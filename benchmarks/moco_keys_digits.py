"""MoCo v3 keys under gradient accumulation, CPU: one optimizer batch split 4 ways with micro-batch keys vs
full-batch keys vs the true large batch (no accumulation), same seed, same epochs, on the bundled digits.

    .venv/bin/python benchmarks/moco_keys_digits.py                        # batch 128 = 4 x 32, 5 epochs, seed 0
    .venv/bin/python benchmarks/moco_keys_digits.py --epochs 20 --seed 1   # longer, another seed
    .venv/bin/python benchmarks/moco_keys_digits.py --batch-size 64 --epochs 3 --train-limit 1024 --probe-epochs 10
                                                                           # the quick one a loaded 2-core CPU allows

Each setting is `trainlab train moco --config moco_v3_digits --batch-size B --epochs E` with `--grad-accumulation 4
--moco-keys micro-batch` (each query against the 31 other keys of its micro-batch), `--grad-accumulation 4
--moco-keys full-batch` (against the 127 other keys of the optimizer batch) or `--grad-accumulation 1` (the large
batch itself), then `trainlab eval knn` and `trainlab eval linear-probe` on its checkpoint. The three differ in the
keys only where the first two differ, and in BatchNorm's statistics (per micro-batch of 32 in both accumulated
runs, of 128 in the large batch): full-batch keys vs the large batch measures what BatchNorm alone leaves.
One seed shows one draw: differences of a point or two in accuracy are within the seed-to-seed spread of such short
runs, which this script does not measure unless run with several --seed values.
"""

# Legend: none (no tensors are named here).

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
SETTINGS = {  # name: extra train flags
    "micro-batch keys (4 x B/4)": ["--grad-accumulation", "4", "--moco-keys", "micro-batch"],
    "full-batch keys (4 x B/4)": ["--grad-accumulation", "4", "--moco-keys", "full-batch"],
    "large batch (1 x B)": ["--grad-accumulation", "1"],
}


def run_cli(args: list[str]) -> tuple[str, float]:
    """Run `python -m trainlab ARGS`; returns (stdout, wall seconds). Raises on a non-zero exit."""
    cmd = [sys.executable, "-m", "trainlab", *args]
    print("$ trainlab " + " ".join(args), flush=True)
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


def one_setting(work: Path, name: str, flags: list[str], args: argparse.Namespace) -> dict[str, Any]:
    run = work / name.split(" (")[0].replace(" ", "-")
    train = ["train", "moco", "--config", CONFIG, "--run-dir", str(run / "pretrain"), "--overwrite"]
    train += ["--batch-size", str(args.batch_size), "--epochs", str(args.epochs), "--seed", str(args.seed)]
    train += ["--eval-every-epochs", str(args.epochs), "--data.train-limit", str(args.train_limit), *flags]
    _, wall = run_cli(train)
    ckpt = str(run / "pretrain" / "ckpt" / "last.pt")
    knn, _ = run_cli(["eval", "knn", "--data.kind", "digits", "--image-size", "16", "--moco-weights", ckpt])
    probe = ["eval", "linear-probe", "--moco-weights", ckpt, "--run-dir", str(run / "probe"), "--overwrite"]
    probe += ["--epochs", str(args.probe_epochs), "--seed", str(args.seed)]
    probe_out, _ = run_cli(probe)
    rows = [json.loads(line) for line in (REPO / run / "pretrain" / "metrics.jsonl").read_text().splitlines()]
    losses = [(r["step"], r["loss"]) for r in rows if r["kind"] == "train"]
    return {
        "train_command": train,
        "pretrain_wall_s": round(wall, 1),
        "knn_accuracy": last_json(knn)["knn_accuracy"],
        "linear_probe": last_json(probe_out),
        "loss_by_step": losses,
    }


def plot(results: dict[str, dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for name, r in results.items():
        steps, losses = zip(*r["loss_by_step"], strict=True)
        ax.plot(steps, losses, lw=1, label=name)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("symmetric InfoNCE loss (x 2T)")
    ax.set_title("MoCo v3 keys under accumulation, digits, one seed")
    ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", default="runs/moco-keys-bench", help="run directories (relative: repo root)")
    parser.add_argument("--batch-size", type=int, default=128, help="optimizer batch B (split 4 ways)")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--train-limit", type=int, default=0, help="pretrain on the first N digits (0: all 4,000)")
    parser.add_argument("--probe-epochs", type=int, default=30, help="linear-probe epochs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--figure", default="", help="loss-curve figure path ('' = none)")
    parser.add_argument("--json", default="auto", help="result path; 'auto' = results/moco_keys_digits_<time>.json")
    args = parser.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    env = environment()
    work = Path(args.work_dir)
    results = {name: one_setting(work, name, flags, args) for name, flags in SETTINGS.items()}
    if args.figure:
        plot(results, REPO / args.figure)
    summary = {
        name: {
            "knn_accuracy": r["knn_accuracy"],
            "linear_probe": r["linear_probe"],
            "final_loss": r["loss_by_step"][-1][1],
            "pretrain_wall_s": r["pretrain_wall_s"],
        }
        for name, r in results.items()
    }
    print(json.dumps(summary, indent=1))
    result = {"settings": settings(args), "results": results, "environment": env}
    result["environment"]["load_average_1min_end"] = round(os.getloadavg()[0], 2)
    write_result(result_path(args.json, "moco_keys_digits", "cpu"), result)


if __name__ == "__main__":
    main()
