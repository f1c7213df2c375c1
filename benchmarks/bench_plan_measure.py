"""Accuracy of `trainlab plan RECIPE ... --measure`: its measured s/step against a real `trainlab train` run's
steady-state s/step, same config, same device, in one process, alternating.

    .venv/bin/python benchmarks/bench_plan_measure.py --label sharedmachine          # JSON result in results/
    .venv/bin/python benchmarks/bench_plan_measure.py --rounds 1 --recipes toy --json ''   # smoke run

On a shared machine other processes take the cores for a while, and wall-clock steps move by +-50 % from one run to
the next; `--clock thread` reads the main thread's CPU time instead (all the work with 1 torch thread and no loader
workers), the cost of the step without the contention.

Cases: each recipe's debug variant (`engine.debug.debug_run_config`, the golden runs' configs): toy, CIFAR VGG
(`cifar_vgg_debug`), VAR debug and MoCo ViT debug, on the CPU, `--epochs` epochs, `--num-workers 0`, no TensorBoard,
no progress bar; and, when named, the control `toy_long_epochs`: toy's step in epochs of 64 steps instead of 8 (the
training run's epoch ends, with their checkpoint writes and evaluation, slow the steps after them: with 8-step epochs
every steady step follows one). Both commands are the real ones (`trainlab.cli.main`), given the same config file:
- train: each optimizer step's wall time is the time between two consecutive calls of the run's progress display
  (`RunProgress.update`, once per step, after the step and its logging); steady state = the median over the steps
  of the second and later epochs, without each epoch's first step (it also holds the previous epoch's evaluation and
  checkpoints, and the FLOP count: `engine/throughput.py`);
- plan --measure: `measured_step_seconds` of `--json` (the Trainer's loop: 3 warm-up steps, then `--steps` timed
  ones, each from the previous step's end or its epoch's start to its end; median) and `projected_step_seconds`.
  Every case's data is on this machine, so `--measure` draws its batches through the recipe's training loader
  (`measured_data`: "loader") and the projection is the measured step itself;
  `--synthetic` makes the recipe's data look absent (its `build_data` raises, as for a missing folder): synthetic
  batches, and the projection adds the data pipeline's time per step at the per-core rate
  `trainlab bench data RECIPE --json` measured first (stored in a temporary `$TRAINLAB_CACHE`).
Reported per case: the median over rounds of both, projected / real - 1 (the target: within 10 %), "paired" (the
median over rounds of each round's projected / real - 1, the two runs of a round neighbours in time), the real run's
`data_wait_fraction` (the share of its time spent fetching batches in this process) and --measure's (the median time
inside the loader over the median step; synthetic batches: none). Also the cost of the training FLOP count: the counted
step's time (inside `count_flops`) over the median uncounted step (the bench counts each epoch's first step, outside
the steady state; training counts at most once in `throughput.RECOUNT_STEPS` steps).
"""

# Legend: none (no tensors are named here).

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import yaml
from _env import environment, result_path, settings, write_result

from trainlab.cli import main as trainlab_main
from trainlab.config import to_dict
from trainlab.engine import throughput
from trainlab.engine.debug import debug_run_config
from trainlab.engine.loop import Trainer
from trainlab.engine.metrics import RunProgress
from trainlab.errors import UsageError
from trainlab.memory.run_cost import data_rate_path
from trainlab.recipes import get_recipe

# case -> (recipe, model of the full-size config whose debug variant runs: '' keeps the recipe's default, fields set
# on the debug config)
CASES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "toy": ("toy", "", {}),
    "cifar_vgg_debug": ("cifar", "cifar_vgg19", {}),
    "var_debug": ("var", "", {}),
    "moco_vit_debug": ("moco", "moco_vit_small", {}),
    # the control: toy's step (same model, batch and data) in epochs of 64 steps instead of 8, so that most of the
    # training run's steady steps are far from an epoch's end (its checkpoint writes and evaluation)
    "toy_long_epochs": ("toy", "", {"num_samples": 1024}),
}
DEFAULT_CASES = ["toy", "cifar_vgg_debug", "var_debug", "moco_vit_debug"]

_update = RunProgress.update
_stamps: list[tuple[int, float]] = []
_count_flops = throughput.count_flops
_counted_seconds: list[float] = []


def _timed_update(self: RunProgress, step: int, metrics: dict[str, float]) -> None:
    _stamps.append((step, time.perf_counter()))
    _update(self, step, metrics)


def _timed_count(run: Any) -> Any:
    began = time.perf_counter()
    try:
        return _count_flops(run)
    finally:
        _counted_seconds.append(time.perf_counter() - began)


def write_config(case: str, epochs: int, folder: Path) -> Path:
    """The case's debug config (run for `epochs` epochs on the CPU, data read in this process) as a YAML file."""
    recipe_name, model, fields = CASES[case]
    recipe_cls = get_recipe(recipe_name)
    full = recipe_cls.config_class()
    if model:
        full = dataclasses.replace(full, model=model)  # type: ignore[call-arg]
    config = debug_run_config(recipe_cls(full))
    config = dataclasses.replace(
        config,
        epochs=epochs,
        device="cpu",
        num_workers=0,
        tensorboard=False,
        progress=False,
        log_every=100_000,
        **fields,
    )
    path = folder / f"{case}.yaml"
    path.write_text(yaml.safe_dump(to_dict(config), sort_keys=False))
    return path


def store_data_rate(recipe: str, config: Path, seconds: float) -> float:
    """`trainlab bench data RECIPE --json` with the config, stored where `--measure` reads it (`$TRAINLAB_CACHE`)."""
    out = io.StringIO()
    argv = ["bench", "data", recipe, "--config", str(config), "--seconds", str(seconds), "--json"]
    with contextlib.redirect_stdout(out):
        code = trainlab_main(argv)
    if code != 0:
        raise SystemExit(f"trainlab {' '.join(argv)} failed")
    path = data_rate_path(recipe)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(out.getvalue())
    return float(json.loads(out.getvalue())["samples_per_second_per_core"])


def real_run(recipe: str, config: Path, run_dir: Path) -> dict[str, Any]:
    """`trainlab train` with the config: its steady-state s/step and the counted steps' cost."""
    _stamps.clear()
    _counted_seconds.clear()
    argv = ["train", recipe, "--config", str(config), "--run-dir", str(run_dir)]
    recount = throughput.RECOUNT_STEPS
    throughput.RECOUNT_STEPS = 1  # count each epoch's first step (outside the steady state) to time counting
    try:
        code = trainlab_main(argv)
    finally:
        throughput.RECOUNT_STEPS = recount  # --measure's loop counts as training does: its first step only
    if code != 0:
        raise SystemExit(f"trainlab {' '.join(argv)} failed")
    stamps = list(_stamps)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    per_epoch = next(r for r in rows if r["kind"] == "event")["steps_per_epoch"]
    seconds = {step: t - stamps[i - 1][1] for i, (step, t) in enumerate(stamps) if i > 0}
    steady = [t for step, t in seconds.items() if step > per_epoch and (step - 1) % per_epoch != 0]
    median = statistics.median(steady)
    summary = [r for r in rows if r["kind"] == "summary"][-1]
    return {
        "data_wait_fraction": summary.get("data_wait_fraction"),
        "steps_per_epoch": per_epoch,
        "steady_steps": len(steady),
        "steady_step_seconds": median,
        "counted_step_seconds": list(_counted_seconds),
        # the run's first step is also its warm-up: the cost of counting is read on the later epochs' counts
        "counted_over_median": statistics.median(_counted_seconds[1:]) / median,
    }


@contextlib.contextmanager
def without_epoch_end() -> Any:
    """`--without-epoch-end`: the training run with nothing saved or evaluated between epochs (as --measure's loop)."""
    save, end_of_epoch = Trainer.save, Trainer._end_of_epoch

    def no_save(self: Trainer, *, is_best: bool = False) -> None:
        return None

    def no_end_of_epoch(self: Trainer, logger: Any, stop: Any) -> dict[str, float]:
        return {}

    Trainer.save, Trainer._end_of_epoch = no_save, no_end_of_epoch  # type: ignore[method-assign]
    try:
        yield
    finally:
        Trainer.save, Trainer._end_of_epoch = save, end_of_epoch  # type: ignore[method-assign]


def absent_data(self: Any, parts: Any, device: Any) -> Any:
    """`--synthetic`: the recipe's `build_data` as where the data is not on the machine."""
    raise UsageError("the data is not on this machine (bench_plan_measure.py --synthetic)")


def measured_run(recipe: str, config: Path, steps: int, synthetic: bool) -> dict[str, Any]:
    """`trainlab plan --measure --json` with the config."""
    out = io.StringIO()
    argv = ["plan", recipe, "--config", str(config), "--measure", "--steps", str(steps), "--json"]
    recipe_cls = get_recipe(recipe)
    build_data = recipe_cls.build_data
    if synthetic:
        recipe_cls.build_data = absent_data  # type: ignore[method-assign]
    try:
        with contextlib.redirect_stdout(out):
            code = trainlab_main(argv)
    finally:
        recipe_cls.build_data = build_data  # type: ignore[method-assign]
    if code != 0:
        raise SystemExit(f"trainlab {' '.join(argv)} failed")
    result = json.loads(out.getvalue())
    return {k: v for k, v in result.items() if k.startswith(("measured_", "projected_"))}


def measured_wait(x: dict[str, Any]) -> float:
    """--measure's share of the step inside the loader (0 for synthetic batches)."""
    data = x["measured_data_seconds_per_step"] if x["measured_data"] == "loader" else 0.0
    return float(data / x["measured_step_seconds"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", nargs="+", default=DEFAULT_CASES, choices=list(CASES), help="cases")
    parser.add_argument("--epochs", type=int, default=4, help="epochs of the real run (the first is not counted)")
    parser.add_argument("--steps", type=int, default=20, help="plan --measure --steps")
    parser.add_argument("--data-seconds", type=float, default=3.0, help="trainlab bench data --seconds per case")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of (train, measure), alternating the order")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--synthetic", action="store_true", help="--measure as where the data is not on the machine: "
                        "synthetic batches plus the stored data rate")  # fmt: skip
    parser.add_argument("--clock", choices=["wall", "thread"], default="wall", help="thread: every clock in this "
                        "process reads the main thread's CPU time (with 1 torch thread and no loader workers, all the "
                        "work), so other processes on a shared machine do not move the numbers")  # fmt: skip
    parser.add_argument("--without-epoch-end", action="store_true", help="also a third run per round: training "
                        "with nothing saved or evaluated between epochs (as --measure's loop)")  # fmt: skip
    parser.add_argument("--label", default="", help="what differed (sharedmachine, idlemachine), for the file name")
    parser.add_argument("--json", default="auto", help="result file; auto: results/plan_measure_...; '': none")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.clock == "thread":
        time.perf_counter = time.thread_time  # the loop's, --measure's, the data-wait clock's and this file's
    RunProgress.update = _timed_update  # type: ignore[method-assign]
    throughput.count_flops = _timed_count

    cases: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-plan-measure-") as folder:
        os.environ["TRAINLAB_CACHE"] = str(Path(folder) / "cache")  # the data rates stored here, nothing else
        for case in args.recipes:
            recipe = CASES[case][0]
            config = write_config(case, args.epochs, Path(folder))
            per_core = store_data_rate(recipe, config, args.data_seconds)
            real: list[dict[str, Any]] = []
            measured: list[dict[str, Any]] = []
            no_end: list[dict[str, Any]] = []
            kinds = ("train", "measure", "train_without_epoch_end")[: 3 if args.without_epoch_end else 2]
            for r in range(args.rounds):
                for kind in kinds if r % 2 == 0 else kinds[::-1]:
                    if kind == "train":
                        real.append(real_run(recipe, config, Path(folder) / f"{case}_{r}"))
                    elif kind == "measure":
                        measured.append(measured_run(recipe, config, args.steps, args.synthetic))
                    else:
                        with without_epoch_end():
                            no_end.append(real_run(recipe, config, Path(folder) / f"{case}_{r}_without_epoch_end"))
                print(
                    f"{case} round {r + 1}/{args.rounds}: real {real[-1]['steady_step_seconds'] * 1e3:.2f} ms/step, "
                    f"measured {measured[-1]['measured_step_seconds'] * 1e3:.2f} ms/step, projected with data "
                    f"{measured[-1]['projected_step_seconds'] * 1e3:.2f} ms/step",
                    flush=True,
                )
            real_s = statistics.median(x["steady_step_seconds"] for x in real)
            wait = statistics.median(x["data_wait_fraction"] for x in real)
            measured_s = statistics.median(x["measured_step_seconds"] for x in measured)
            projected_s = statistics.median(x["projected_step_seconds"] for x in measured)
            cases[case] = {
                "measured_data": measured[-1]["measured_data"],
                "measured_data_wait_fraction": statistics.median(measured_wait(x) for x in measured),
                "data_samples_per_second_per_core": per_core,
                "projected_step_seconds": projected_s,
                "projected_over_real_minus_1": projected_s / real_s - 1,
                "projected_within_10_percent": abs(projected_s / real_s - 1) <= 0.10,
                "paired_projected_over_real_minus_1": statistics.median(
                    m["projected_step_seconds"] / x["steady_step_seconds"] - 1 for m, x in zip(measured, real)
                ),
                "real_step_seconds": real_s,
                "real_step_seconds_without_data_wait": real_s * (1 - wait),
                "measured_step_seconds": measured_s,
                "measured_over_real_minus_1": measured_s / real_s - 1,
                "measured_over_real_without_data_wait_minus_1": measured_s / (real_s * (1 - wait)) - 1,
                "within_10_percent": abs(measured_s / real_s - 1) <= 0.10,
                "counted_step_over_median": statistics.median(x["counted_over_median"] for x in real),
                "real_data_wait_fraction": wait,
                "real": real,
                "measured": measured,
            }
            if no_end:
                cases[case]["without_epoch_end"] = {
                    "real_step_seconds": statistics.median(x["steady_step_seconds"] for x in no_end),
                    "paired_over_real_minus_1": statistics.median(
                        e["steady_step_seconds"] / x["steady_step_seconds"] - 1 for e, x in zip(no_end, real)
                    ),
                    "paired_projected_over_it_minus_1": statistics.median(
                        m["projected_step_seconds"] / e["steady_step_seconds"] - 1 for m, e in zip(measured, no_end)
                    ),
                    "real": no_end,
                }

    print("\n| case | train s/step | its data wait | --measure batches | its data wait | projected | vs train | "
          "paired | counted step |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for case, c in cases.items():
        print(
            f"| {case} | {c['real_step_seconds'] * 1e3:.2f} ms | {c['real_data_wait_fraction']:.1%} | "
            f"{c['measured_data']} | {c['measured_data_wait_fraction']:.1%} | "
            f"{c['projected_step_seconds'] * 1e3:.2f} ms | {c['projected_over_real_minus_1']:+.1%} | "
            f"{c['paired_projected_over_real_minus_1']:+.1%} | "
            f"x{c['counted_step_over_median']:.2f} |"
        )
    for case, c in cases.items():
        if "without_epoch_end" in c:
            e = c["without_epoch_end"]
            print(
                f"{case}: train without epoch ends {e['real_step_seconds'] * 1e3:.2f} ms/step, paired vs train "
                f"{e['paired_over_real_minus_1']:+.1%}; projected vs it, paired: "
                f"{e['paired_projected_over_it_minus_1']:+.1%}"
            )
    write_result(
        result_path(
            args.json,
            "plan_measure",
            f"cpu{args.threads}t",
            f"{args.clock}clock",
            "synthetic" if args.synthetic else "loader",
            args.label,
        ),
        {"settings": settings(args), "environment": environment(), "cases": cases},
    )


if __name__ == "__main__":
    main()
