"""Cost of training-health logging, step by step: `trainlab train cifar` run in this process with `--health-every 2`,
so observed and unobserved optimizer steps alternate and each observed step is compared with its two neighbours,
under the same machine load.

    .venv/bin/python benchmarks/bench_health.py --label sharedmachine        # JSON result in results/
    .venv/bin/python benchmarks/bench_health.py --repeats 1 --steps 8 --json ''   # smoke run

The command is the real one (`trainlab.cli.main(["train", "cifar", ...])`, fake CIFAR data, `--num-workers 0`, no
TensorBoard, no progress bar, metrics logged only at the first and last step). Each optimizer step's wall time is
the time between two consecutive calls of the run's progress display (`RunProgress.update`, called once per step
after the step itself, its health logging and its metric logging), so it covers everything the loop does for a
step. Only steps inside the second and later epochs count (the first epoch warms up; the first step of an epoch
also holds the previous epoch's evaluation and checkpoint). Reported:
- `observed_ratio`: the median over observed steps of (its time / the mean time of its two neighbours);
- `control_ratio`: the same pairing in a run with `--health-every 0`, alternating with the health runs: what the
  method gives when nothing differs (about 1; its spread is the noise floor);
- the cost of one observed step (`observed_ratio - control_ratio`) and at the default cadence (that / 200);
- the engine's own measurement: the health rows' `health_seconds` (the monitor's own time per observed step) and
  `overhead` (that time as a share of the time since the previous observed step).
"""

# Legend: none (no tensors are named here).

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _env import environment, result_path, settings, write_result

from trainlab.cli import main as trainlab_main
from trainlab.engine.metrics import RunProgress
from trainlab.engine.recipe import TrainConfig

DEFAULT_EVERY = TrainConfig.__dataclass_fields__["health_every"].default
_update = RunProgress.update
_stamps: list[tuple[int, float]] = []


def _timed_update(self: RunProgress, step: int, metrics: dict[str, float]) -> None:
    _stamps.append((step, time.perf_counter()))
    _update(self, step, metrics)


def step_seconds(stamps: list[tuple[int, float]]) -> dict[int, float]:
    """1-based step -> its wall time (from the previous step's stamp to its own)."""
    return {step: t - stamps[i - 1][1] for i, (step, t) in enumerate(stamps) if i > 0}


def neighbour_ratios(seconds: dict[int, float], steps_per_epoch: int, every: int) -> list[float]:
    """For each even step of the second and later epochs whose neighbours are in the same epoch: its time / the
    mean of its neighbours' (with `every` 2 the even steps are the observed ones)."""
    ratios = []
    for step, t in seconds.items():
        in_epoch = (step - 1) % steps_per_epoch  # 0 for an epoch's first step
        if step % every or step <= steps_per_epoch or in_epoch in (0, 1) or in_epoch == steps_per_epoch - 1:
            continue
        if step - 1 in seconds and step + 1 in seconds:
            ratios.append(t / ((seconds[step - 1] + seconds[step + 1]) / 2))
    return ratios


def run(args: argparse.Namespace, run_dir: Path, every: int) -> dict[str, Any]:
    argv = [
        "train",
        "cifar",
        "--model",
        args.model,
        "--data.kind",
        "fake",
        "--data.fake-size",
        str(args.steps * args.batch_size),
        "--batch-size",
        str(args.batch_size),
        "--epochs",
        str(args.epochs),
        "--device",
        "cpu",
        "--num-workers",
        "0",
        "--tensorboard",
        "false",
        "--progress",
        "false",
        "--log-every",
        "100000",
        "--health-every",
        str(every),
        "--run-dir",
        str(run_dir),
    ]
    _stamps.clear()
    if trainlab_main(argv) != 0:
        raise SystemExit(f"trainlab {' '.join(argv)} failed")
    seconds = step_seconds(list(_stamps))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    health = [r for r in rows if r["kind"] == "health"]
    return {
        "every": every,
        "median_step_seconds": statistics.median(seconds.values()),
        "ratios": neighbour_ratios(seconds, args.steps, 2),
        "health_seconds": [r["health_seconds"] for r in health],
        "overhead": [r["overhead"] for r in health if "overhead" in r],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="cifar_resnet_debug", help="cifar --model (cifar_resnet_debug: 9 ReLU "
                        "outputs, 88 k parameters, where the monitor's fixed work weighs the most; cifar_resnet18: "
                        "11.2 M)")  # fmt: skip
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps per epoch")
    parser.add_argument("--epochs", type=int, default=2, help="epochs per run (the first is not counted)")
    parser.add_argument("--repeats", type=int, default=3, help="pairs of runs (health every 2 steps, then off)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--label", default="", help="what differed (sharedmachine, idlemachine), for the file name")
    parser.add_argument("--json", default="auto", help="result file; auto: results/health_overhead_...; '': none")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    RunProgress.update = _timed_update  # type: ignore[method-assign]

    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-health-") as folder:
        for r in range(args.repeats):
            for every in (2, 0) if r % 2 == 0 else (0, 2):
                runs.append(run(args, Path(folder) / f"every{every}_{r}", every))
                last = runs[-1]
                print(
                    f"round {r + 1}/{args.repeats} health-every {every}: median step "
                    f"{last['median_step_seconds'] * 1e3:.1f} ms, even/neighbours "
                    f"{statistics.median(last['ratios']):.4f} over {len(last['ratios'])} steps",
                    flush=True,
                )

    observed = [x for r in runs if r["every"] == 2 for x in r["ratios"]]
    control = [x for r in runs if r["every"] == 0 for x in r["ratios"]]
    health_seconds = [x for r in runs for x in r["health_seconds"]]
    overhead = [x for r in runs for x in r["overhead"]]
    per_observed = statistics.median(observed) - statistics.median(control)
    step_ms = statistics.median(r["median_step_seconds"] for r in runs) * 1e3
    summary = {
        "median_step_ms": step_ms,
        "observed_ratio": statistics.median(observed),
        "control_ratio": statistics.median(control),
        "observed_ratio_quartiles": statistics.quantiles(observed, n=4),
        "control_ratio_quartiles": statistics.quantiles(control, n=4),
        "pairs": {"observed": len(observed), "control": len(control)},
        "cost_of_one_observed_step": per_observed,
        "default_health_every": DEFAULT_EVERY,
        "cost_at_default_cadence": per_observed / DEFAULT_EVERY,
        "health_seconds_median": statistics.median(health_seconds),
        "in_run_overhead_median_every_2": statistics.median(overhead),
        "in_run_overhead_at_default_cadence": statistics.median(health_seconds) / (DEFAULT_EVERY * step_ms / 1e3),
    }
    print(
        f"step {step_ms:.1f} ms; an observed step takes x{summary['observed_ratio']:.4f} its neighbours (control "
        f"x{summary['control_ratio']:.4f}): {per_observed:+.2%} of a step, so --health-every {DEFAULT_EVERY} costs "
        f"{per_observed / DEFAULT_EVERY:+.4%}; the monitor's own time {summary['health_seconds_median'] * 1e3:.2f} ms "
        f"per observed step = {summary['in_run_overhead_at_default_cadence']:.4%} at the default cadence"
    )
    write_result(
        result_path(args.json, "health_overhead", f"cifar_{args.model}", f"cpu{args.threads}t", args.label),
        {"settings": settings(args), "environment": environment(), "runs": runs, "summary": summary},
    )


if __name__ == "__main__":
    main()
