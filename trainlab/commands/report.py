"""`trainlab report RUN_DIR [RUN_DIR ...] [--out DIR]`: plots and a results table from run directories.

One run: loss vs step (every loss a recipe logs: `generator/loss` and `discriminator/loss` for the tokenizer) and
accuracy vs epoch, or the recipe's tracked metric (`eval.png`: VAR's validation cross-entropy, the tokenizer's PSNR)
(default output `RUN_DIR/plots`). Several runs: the precision-lab comparison (loss, accuracy or metric, memory, time,
metric vs time), with runs that differ only in their seed aggregated (default output `<common parent>/report`). Both
write `results.md` and `results.csv` next to the plots. A folder without `metrics.jsonl` is searched for the run
directories under it. Comparing runs of different recipes or models prints a warning: their numbers are not
comparable.

    trainlab report runs/cifar-fp32
    trainlab report runs/bench --out runs/bench/report
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

from trainlab.config import option, parse
from trainlab.errors import UsageError
from trainlab.report.runs import different_kinds, find_run_dirs, group_runs, load_run, summarize_run
from trainlab.report.tables import write_results_table

log = logging.getLogger(__name__)


@dataclasses.dataclass(kw_only=True)
class ReportConfig:
    """Plots and a results table from one run (loss, accuracy) or several (precision-lab comparison)."""

    run_dirs: list[Path] = option(
        help="run directories (with metrics.jsonl), or folders to search for them", positional=True, metavar="RUN_DIR"
    )
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
            if not (run_dir / "metrics.jsonl").is_file() and not find_run_dirs(run_dir):
                raise UsageError(
                    f"no metrics.jsonl in {run_dir} nor in any folder under it; pass directories written by "
                    "`trainlab train`"
                )
        if len(set(map(Path.resolve, self.run_dirs))) != len(self.run_dirs):
            raise UsageError("the same run directory is listed twice")

    def expanded_run_dirs(self) -> list[Path]:
        """The run directories: each argument itself when it holds metrics.jsonl, else the runs found under it."""
        found: list[Path] = []
        for run_dir in self.run_dirs:
            found += [run_dir] if (run_dir / "metrics.jsonl").is_file() else find_run_dirs(run_dir)
        return list(dict.fromkeys(found))


def main(argv: list[str]) -> int:
    """Runs the report command; `argv` excludes the program and subcommand names. Returns the exit code."""
    config = parse(ReportConfig, argv, prog="trainlab report", epilog=__doc__ or "")
    from trainlab.report.plots import plot_comparison, plot_run  # matplotlib: only once the arguments are good

    run_dirs = config.expanded_run_dirs()
    if run_dirs != config.run_dirs:
        log.info("found %d run directories: %s", len(run_dirs), ", ".join(map(str, run_dirs)))
    differ = different_kinds([load_run(d) for d in run_dirs]) if len(run_dirs) > 1 else ""
    if differ:
        log.warning("comparing runs of different %s: their losses and metrics are not comparable", differ)
    if len(run_dirs) == 1:
        out_dir = config.out or run_dirs[0] / "plots"
        paths = plot_run(run_dirs[0], out_dir)
        rows = [summarize_run(run_dirs[0])]
    else:
        parent = config.run_dirs[0] if len(config.run_dirs) == 1 else None  # one folder searched: its report/
        out_dir = config.out or (parent or Path(os.path.commonpath([p.resolve() for p in run_dirs]))) / "report"
        groups = group_runs(run_dirs)
        paths = plot_comparison(groups, out_dir)
        rows = [summarize_run(run_dir, label) for label, dirs in groups.items() for run_dir in dirs]
    md_path, csv_path = out_dir / "results.md", out_dir / "results.csv"
    write_results_table(rows, md_path, csv_path)
    for path in [*paths, md_path, csv_path]:
        print(path)
    return 0
