"""`trainlab report RUN_DIR [RUN_DIR ...] [--out DIR]`: plots and a results table from run directories.

One run: loss vs step and accuracy vs epoch (default output `RUN_DIR/plots`). Several runs: the precision-lab
comparison (loss, accuracy, memory, time, accuracy vs time), with runs that differ only in their seed aggregated
(default output `<common parent>/report`). Both write `results.md` and `results.csv` next to the plots.

    trainlab report runs/cifar-fp32
    trainlab report runs/bench/* --out runs/bench/report
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from trainlab.errors import UsageError
from trainlab.report.plots import group_runs, plot_comparison, plot_run, summarize_run, write_results_table


def main(argv: list[str]) -> int:
    """Runs the report command; `argv` excludes the program and subcommand names. Returns the exit code."""
    parser = argparse.ArgumentParser(
        prog="trainlab report",
        description="Plots and a results table from one run (loss, accuracy) or several (precision-lab comparison; "
        "runs differing only in seed are aggregated).",
    )
    parser.add_argument(
        "run_dirs", nargs="+", type=Path, metavar="RUN_DIR", help="run directories (with metrics.jsonl)"
    )
    parser.add_argument("--out", type=Path, default=None, help="output directory for the PNGs and results tables")
    args = parser.parse_args(argv)

    run_dirs: list[Path] = args.run_dirs
    for run_dir in run_dirs:
        if not run_dir.is_dir():
            raise UsageError(f"run directory {run_dir} does not exist; pass directories written by `trainlab train`")
        if not (run_dir / "metrics.jsonl").is_file():
            raise UsageError(f"no metrics.jsonl in {run_dir}; pass directories written by `trainlab train`")
    if len(set(map(Path.resolve, run_dirs))) != len(run_dirs):
        raise UsageError("the same run directory is listed twice")

    if len(run_dirs) == 1:
        out_dir = args.out or run_dirs[0] / "plots"
        paths = plot_run(run_dirs[0], out_dir)
        rows = [summarize_run(run_dirs[0])]
    else:
        out_dir = args.out or Path(os.path.commonpath([p.resolve() for p in run_dirs])) / "report"
        groups = group_runs(run_dirs)
        paths = plot_comparison(groups, out_dir)
        rows = [summarize_run(run_dir, label) for label, dirs in groups.items() for run_dir in dirs]
    md_path, csv_path = out_dir / "results.md", out_dir / "results.csv"
    write_results_table(rows, md_path, csv_path)
    for path in [*paths, md_path, csv_path]:
        print(path)
    return 0
