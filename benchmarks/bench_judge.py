"""Train the digit judge with the demo's settings (`trainlab train judge`); print held-out accuracy and time per seed.

    .venv/bin/python benchmarks/bench_judge.py                      # 16x16, seeds 0 1 2, 1 CPU thread
    .venv/bin/python benchmarks/bench_judge.py --resolution 32 --threads 2 --json runs/bench_judge.json

The JSON result (per seed, plus the environment) goes to results/judge_<...>_<date>.json unless `--json` says
otherwise (`--json ''`: none).

Each seed trains a fresh judge on the engine (the `judge` recipe's defaults: 10 epochs on the 4,000 "train"
digits) and is scored on the 1,000 "heldout" digits (the recipe's last evaluation). Wall-clock time covers the whole
`Trainer.fit` (the augmented views are made in the loader, evaluations included). One CPU thread is the
default because these tiny convolutions gain little from a second thread and, on a busy 2-core machine, OpenMP
waiting makes two threads several times slower.
"""

# Legend: none (no tensors are named here).

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from _env import environment, result_path, settings, write_result

from trainlab.engine.loop import Trainer
from trainlab.recipes.judge import JudgeConfig, JudgeRecipe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--resolution", type=int, default=16, help="image side: 16 (demo) or 32")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="one judge per seed")
    parser.add_argument("--epochs", type=int, default=JudgeConfig().epochs, help="passes over the train digits")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--json", default="auto", help="result file ('auto': results/judge_<...>_<date>.json)")
    parser.add_argument("--label", default="", help="what distinguishes this run (e.g. idlemachine), in the auto name")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    env = environment()
    runs = []
    for seed in args.seeds:
        with tempfile.TemporaryDirectory() as work:
            config = JudgeConfig(
                run_dir=Path(work),
                seed=seed,
                image_size=args.resolution,
                epochs=args.epochs,
                device=args.device,
                eval_every_epochs=args.epochs,
                log_every=50,
                tensorboard=False,
                progress=False,
            )
            start = time.perf_counter()
            result = Trainer(JudgeRecipe(config)).fit()
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            seconds = time.perf_counter() - start
        acc = result.last_eval["heldout_accuracy"]
        runs.append({"seed": seed, "heldout_accuracy": acc, "train_seconds": seconds})
        print(f"seed {seed}: held-out accuracy {acc:.4f}, training {seconds:.1f} s", flush=True)

    accs = [run["heldout_accuracy"] for run in runs]
    secs = [run["train_seconds"] for run in runs]
    print(
        f"{args.resolution}x{args.resolution}, {args.epochs} epochs, {len(runs)} seeds: "
        f"held-out accuracy {statistics.mean(accs):.4f} ± {_stdev(accs):.4f} (min {min(accs):.4f}), "
        f"training {statistics.mean(secs):.1f} ± {_stdev(secs):.1f} s"
    )
    device = args.device.replace(":", "") + (f"{args.threads}t" if args.device == "cpu" else "")
    path = result_path(args.json, "judge", f"{args.resolution}px", f"{len(runs)}seeds", device, args.label)
    write_result(path, {"environment": env, "config": settings(args), "runs": runs})


def _stdev(values: list[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else 0.0


if __name__ == "__main__":
    main()
