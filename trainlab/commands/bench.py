"""`trainlab bench precision`: the CIFAR-10 precision lab.

Trains the same model under every precision mode the device can run (x seeds), each in a fresh process so peak
memory is that run's own (CUDA max allocated/reserved on GPU, peak RSS on CPU), then writes a results table
(markdown + CSV) and comparison plots. Extra `trainlab train cifar` flags can follow `--`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from trainlab.config import option, parse
from trainlab.engine.precision import LAB_PRECISIONS, Precision, PrecisionName, check_device_support
from trainlab.errors import UsageError

log = logging.getLogger(__name__)


@dataclasses.dataclass(kw_only=True)
class PrecisionBenchConfig:
    """Run the CIFAR-10 recipe under every precision mode, then tabulate and plot."""

    model: str = option("resnet18", "model name (see `trainlab train cifar --help`)")
    epochs: int = option(30, "epochs per run", ge=1)
    seeds: int = option(1, "seeds per precision mode (mean ± std across them)", ge=1)
    modes: list[PrecisionName] = option(list(LAB_PRECISIONS), "precision modes to run")
    out_dir: Path = option(Path("runs/bench-precision"), "where the runs, table and plots go")
    device: str = option("auto", "cpu, cuda, cuda:N or auto")
    batch_size: int = option(128, "global batch size", gt=0)
    learning_rate: float = option(0.1, "peak learning rate", gt=0)
    data_root: Path = option(Path("data/cifar10"), "folder holding cifar-10-batches-py/")
    fake_data: int = option(0, "N > 0: use a synthetic CIFAR-format set of N images (quick checks)", ge=0)
    max_steps: int = option(-1, "stop each run after this many optimizer steps (-1: all epochs)", ge=1, sentinels=(-1,))
    log_every: int = option(10, "training-metric logging interval (steps)", ge=1)
    num_workers: int = option(2, "DataLoader workers per run", ge=0)

    def validate(self) -> None:
        from trainlab.models.registry import list_models

        if self.model not in list_models():  # a registry, not a Literal: models register themselves
            raise UsageError(f"unknown model {self.model!r}; choose one of: {', '.join(list_models())}")


def runnable_modes(modes: Sequence[str], device_name: str) -> list[str]:
    """The modes this device can run; the others are skipped with a logged reason (never silently)."""
    from trainlab.engine.loop import resolve_device

    device = resolve_device(device_name)
    keep = []
    for mode in modes:
        try:
            check_device_support(Precision.parse(mode), device)
        except UsageError as err:
            log.warning("skipping %s: %s", mode, err)
            continue
        keep.append(mode)
    return keep


def _train_command(cfg: PrecisionBenchConfig, mode: str, seed: int, run_dir: Path, extra: list[str]) -> list[str]:
    return [
        sys.executable, "-m", "trainlab", "train", "cifar",
        "--model", cfg.model, "--precision", mode, "--seed", str(seed), "--epochs", str(cfg.epochs),
        "--batch-size", str(cfg.batch_size), "--learning-rate", str(cfg.learning_rate), "--device", cfg.device,
        "--data-root", str(cfg.data_root), "--fake-data", str(cfg.fake_data), "--max-steps", str(cfg.max_steps),
        "--log-every", str(cfg.log_every), "--num-workers", str(cfg.num_workers), "--run-dir", str(run_dir),
        "--resume", "auto", *extra,
    ]  # fmt: skip


def run_precision_bench(cfg: PrecisionBenchConfig, extra: list[str]) -> Path:
    from trainlab.report.plots import plot_comparison
    from trainlab.report.runs import summarize_run
    from trainlab.report.tables import write_results_table

    modes = runnable_modes(cfg.modes, cfg.device)
    if not modes:
        raise UsageError("none of the requested precision modes can run on this device")
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    groups: dict[str, list[Path]] = {}
    rows = []
    for mode in modes:
        for seed in range(cfg.seeds):
            run_dir = cfg.out_dir / "runs" / f"{cfg.model}-{mode}-seed{seed}"
            done = (run_dir / "metrics.jsonl").is_file() and '"kind": "summary"' in (
                run_dir / "metrics.jsonl"
            ).read_text()
            if not done:
                log.info("bench: %s seed %d -> %s", mode, seed, run_dir)
                env = dict(os.environ, TRAINLAB_BENCH="1")
                proc = subprocess.run(_train_command(cfg, mode, seed, run_dir, extra), env=env)
                if proc.returncode != 0:
                    raise UsageError(
                        f"the {mode} run (seed {seed}) failed with exit code {proc.returncode}; "
                        f"see its output above and {run_dir}"
                    )
            groups.setdefault(mode, []).append(run_dir)
            rows.append(summarize_run(run_dir, label=mode))
    write_results_table(rows, cfg.out_dir / "results.md", cfg.out_dir / "results.csv")
    plots = plot_comparison(groups, cfg.out_dir / "plots")
    device = "cuda: " + torch.cuda.get_device_name(0) if torch.cuda.is_available() and cfg.device != "cpu" else "cpu"
    (cfg.out_dir / "environment.txt").write_text(
        f"device: {device}\ntorch: {torch.__version__}\nthreads: {torch.get_num_threads()}\n"
    )
    print((cfg.out_dir / "results.md").read_text())
    for path in plots:
        print(path)
    return cfg.out_dir


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: trainlab bench precision [options] [-- extra `trainlab train cifar` flags]")
        print("`trainlab bench precision --help` lists the options.")
        return 0 if argv else 2
    if argv[0] != "precision":
        raise UsageError(f"unknown benchmark {argv[0]!r}; available: precision")
    rest = argv[1:]
    extra: list[str] = []
    if "--" in rest:
        cut = rest.index("--")
        rest, extra = rest[:cut], rest[cut + 1 :]
    cfg = parse(PrecisionBenchConfig, rest, prog="trainlab bench precision")
    run_precision_bench(cfg, extra)
    return 0
