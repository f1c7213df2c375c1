"""`trainlab report RUN_DIR [RUN_DIR ...] [--out DIR]`: plots and a results table from run directories.

One run: loss vs step and accuracy vs epoch (default output `RUN_DIR/plots`). Several runs: the precision-lab
comparison (loss, accuracy, memory, time, accuracy vs time), with runs that differ only in their seed aggregated
(default output `<common parent>/report`). Both write `results.md` and `results.csv` next to the plots.

    trainlab report runs/cifar-fp32
    trainlab report runs/bench/* --out runs/bench/report
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from trainlab.config import option, parse
from trainlab.errors import UsageError
from trainlab.report.runs import group_runs, summarize_run
from trainlab.report.tables import write_results_table


@dataclasses.dataclass(kw_only=True)
class ReportConfig:
    """Plots and a results table from one run (loss, accuracy) or several (precision-lab comparison)."""

    run_dirs: list[Path] = option(help="run directories (with metrics.jsonl)", positional=True, metavar="RUN_DIR")
    out: Path | None = option(
        None, "directory for the PNGs and results tables (one run: RUN_DIR/plots; several: <common parent>/report)"
    )

    def validate(self) -> None:
        if not self.run_dirs:
            raise UsageError("no run directories given; pass directories written by `trainlab train`")
        for run_dir in self.run_dirs:
            if not run_dir.is_dir():
                raise UsageError(
                    f"run directory {run_dir} does not exist; pass directories written by `trainlab train`"
                )
            if not (run_dir / "metrics.jsonl").is_file():
                raise UsageError(f"no metrics.jsonl in {run_dir}; pass directories written by `trainlab train`")
        if len(set(map(Path.resolve, self.run_dirs))) != len(self.run_dirs):
            raise UsageError("the same run directory is listed twice")


def main(argv: list[str]) -> int:
    """Runs the report command; `argv` excludes the program and subcommand names. Returns the exit code."""
    config = parse(ReportConfig, argv, prog="trainlab report", epilog=__doc__ or "")
    from trainlab.report.plots import plot_comparison, plot_run  # matplotlib: only once the arguments are good

    run_dirs = config.run_dirs
    if len(run_dirs) == 1:
        out_dir = config.out or run_dirs[0] / "plots"
        paths = plot_run(run_dirs[0], out_dir)
        rows = [summarize_run(run_dirs[0])]
    else:
        out_dir = config.out or Path(os.path.commonpath([p.resolve() for p in run_dirs])) / "report"
        groups = group_runs(run_dirs)
        paths = plot_comparison(groups, out_dir)
        rows = [summarize_run(run_dir, label) for label, dirs in groups.items() for run_dir in dirs]
    md_path, csv_path = out_dir / "results.md", out_dir / "results.csv"
    write_results_table(rows, md_path, csv_path)
    for path in [*paths, md_path, csv_path]:
        print(path)
    return 0
