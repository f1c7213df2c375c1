"""What a checkpoint costs the run: whole files (rank 0 gathers and writes), sharded folders (`--fsdp`: every rank
writes its shards) and background saves (`--async-checkpoint`), in the command users run.

    .venv/bin/python benchmarks/bench_checkpoint.py --label sharedmachine        # JSON result in results/
    .venv/bin/python benchmarks/bench_checkpoint.py --rounds 1 --steps 10 --json ''   # smoke run

Each case is `torchrun --nproc-per-node 2 -m trainlab train toy` (gloo, CPU) of a wide toy MLP (`--num-features`
x `--hidden`, AdamW: parameters and two optimizer states), `--max-steps` steps, run twice per round: saving after
every step (`--checkpoint-every 1`) and saving only at the end. A save's cost to the run = (the run's wall time with a
save per step - without) / steps; the rounds alternate the cases. Also recorded: rank 0's peak resident-memory growth
over the training loop (`cpu_peak_rss_growth_bytes` of each run's summary) and what the saves add to it (the saving
run's minus the other's), and the size of one checkpoint on disk.

Cases: `ddp` (whole file, written in the step), `ddp-async` (whole file, written in the background), `fsdp` (sharded
folder, written in the step), `fsdp-async` (sharded folder, in the background).
"""

# Legend: none (no tensors are named here).

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _env import environment, result_path, run_metrics, settings, write_result

TORCHRUN = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
TRAIN_TOY = ["-m", "trainlab", "train", "toy"]
CASES: dict[str, list[str]] = {
    "ddp": [],
    "ddp-async": ["--async-checkpoint"],
    "fsdp": ["--fsdp"],
    "fsdp-async": ["--fsdp", "--async-checkpoint"],
}


def _run(args: argparse.Namespace, extra: list[str], every: int, run_dir: Path) -> float:
    """Wall seconds of one 2-process run (start-up included: the same in both runs of a pair)."""
    command = [
        sys.executable,
        *TORCHRUN,
        *TRAIN_TOY,
        "--num-samples",
        str(args.batch_size * args.steps),
        "--batch-size",
        str(args.batch_size),
        "--num-features",
        str(args.num_features),
        "--hidden",
        str(args.hidden),
        "--epochs",
        "1",
        "--checkpoint-every",
        str(every),
        "--keep-checkpoints",
        "2",
        "--tensorboard",
        "false",
        "--progress",
        "false",
        "--run-dir",
        str(run_dir),
        *extra,
    ]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    return seconds


def _checkpoint_bytes(run_dir: Path) -> int:
    ckpt = run_dir / "ckpt"
    folders = sorted(ckpt.glob("step_*.dcp"))
    if folders:
        return sum(p.stat().st_size for p in folders[-1].iterdir()) + (ckpt / "last.pt").stat().st_size
    return (ckpt / "last.pt").stat().st_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per run (one epoch)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--num-features", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--label", default="")
    parser.add_argument("--json", default="auto", help="result file; 'auto': results/checkpoint_<label>_<time>.json")
    args = parser.parse_args()
    cases = [c for c in args.cases.split(",") if c]
    per_round: dict[str, list[dict[str, Any]]] = {case: [] for case in cases}
    with tempfile.TemporaryDirectory() as work:
        for round_index in range(args.rounds):
            order = cases if round_index % 2 == 0 else list(reversed(cases))
            for case in order:
                saving, plain = Path(work) / f"{case}-{round_index}-saving", Path(work) / f"{case}-{round_index}-plain"
                with_saves = _run(args, CASES[case], 1, saving)
                without = _run(args, CASES[case], 0, plain)
                growth = [run_metrics(run)[1].get("cpu_peak_rss_growth_bytes") or 0 for run in (saving, plain)]
                entry = {
                    "seconds_saving_every_step": with_saves,
                    "seconds_saving_at_the_end": without,
                    "seconds_per_save": (with_saves - without) / args.steps,
                    "rank0_peak_rss_growth_bytes": growth[0],
                    "rank0_peak_rss_growth_bytes_saving_at_the_end": growth[1],
                    "rank0_save_rss_bytes": growth[0] - growth[1],
                    "checkpoint_bytes": _checkpoint_bytes(saving),
                }
                per_round[case].append(entry)
                print(f"round {round_index} {case}: {entry}", flush=True)
    result: dict[str, Any] = {"environment": environment(), "settings": settings(args), "cases": {}}
    for case, entries in per_round.items():
        result["cases"][case] = {
            "rounds": entries,
            "median_seconds_per_save": statistics.median(e["seconds_per_save"] for e in entries),
            "median_rank0_peak_rss_growth_bytes": statistics.median(e["rank0_peak_rss_growth_bytes"] for e in entries),
            "median_rank0_save_rss_bytes": statistics.median(e["rank0_save_rss_bytes"] for e in entries),
            "checkpoint_bytes": entries[-1]["checkpoint_bytes"],
        }
    print("case        s/save  rank-0 peak RSS growth  of it the saves  checkpoint")
    for case, row in result["cases"].items():
        growth, saves = row["median_rank0_peak_rss_growth_bytes"] / 2**20, row["median_rank0_save_rss_bytes"] / 2**20
        size = row["checkpoint_bytes"] / 2**20
        seconds = row["median_seconds_per_save"]
        print(f"{case:10s} {seconds:7.3f}  {growth:10.0f} MiB  {saves:12.0f} MiB  {size:6.0f} MiB")
    write_result(result_path(args.json, "checkpoint", args.label), result)


if __name__ == "__main__":
    main()
