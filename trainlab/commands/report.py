"""`trainlab report RUN_DIR [RUN_DIR ...] [--out-dir DIR]`: plots and a results table from run directories.

One run: loss vs step (every loss a recipe logs: `generator/loss` and `discriminator/loss` for the tokenizer) and
accuracy vs epoch, or the recipe's tracked metric (`eval.png`: VAR's validation cross-entropy, the tokenizer's PSNR)
(default output `RUN_DIR/plots`). Several runs: the precision-lab comparison (loss, accuracy or metric, memory, time,
metric vs time), with runs that differ only in their seed aggregated (default output `<common parent>/report`). Both
write `results.md` and `results.csv` next to the plots. A folder without `metrics.jsonl` is searched for the run
directories under it; a folder written by `trainlab bench precision` is reported where the bench wrote its report
(`results.md`, `results.csv`, `plots/`: updated in place, in the bench's order). Comparing runs of different recipes
or models prints a warning: their numbers are not comparable. Among several runs, one whose files are damaged (not
UTF-8, not JSON / YAML) is skipped with a warning naming it; the output folder is checked before anything is drawn.

    trainlab report runs/cifar-fp32
    trainlab report runs/a runs/b --out-dir runs/compare
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path

from trainlab.config import option, parse
from trainlab.engine.run_dir import RunDir
from trainlab.errors import UsageError, check_output_path, first_line
from trainlab.report.runs import different_kinds, group_runs, load_run, summarize_run
from trainlab.report.tables import write_results_table

log = logging.getLogger(__name__)


@dataclasses.dataclass(kw_only=True)
class ReportConfig:
    """Plots and a results table from one run (loss, accuracy) or several (precision-lab comparison)."""

    run_dirs: list[Path] = option(
        help="run directories (with metrics.jsonl), or folders to search for them", positional=True, metavar="RUN_DIR"
    )
    out_dir: Path | None = option(
        None,
        "folder for the PNGs and results tables (one run: RUN_DIR/plots; several: <common parent>/report)",
        metavar="DIR",
        deprecated=("--out",),
    )

    def validate(self) -> None:
        if not self.run_dirs:
            raise UsageError("no run directories given; pass directories written by `trainlab train`")
        for run_dir in self.run_dirs:
            if not run_dir.is_dir():
                raise UsageError(
                    f"run directory {run_dir} does not exist; pass directories written by `trainlab train`"
                )
            if not RunDir(run_dir).metrics.is_file() and not _runs_under(run_dir):
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
            found += [run_dir] if RunDir(run_dir).metrics.is_file() else _runs_under(run_dir)
        return list(dict.fromkeys(found))


def _runs_under(folder: Path) -> list[Path]:
    """The run directories under `folder` that have logged metrics (a report has nothing to show of the others)."""
    return [run.path for run in RunDir.find(folder) if run.metrics.is_file()]


BENCH_MANIFEST = "bench.json"  # what `trainlab bench precision` writes next to its report: its runs, in order


@dataclasses.dataclass
class ReportPlan:
    """What a report reads and where it writes: one run, or labelled groups of runs, and two output folders."""

    run_dirs: list[Path]
    groups: dict[str, list[Path]] | None  # None: the one-run report of run_dirs[0]
    plots_dir: Path
    tables_dir: Path


def readable_runs(run_dirs: list[Path]) -> list[Path]:
    """The run directories whose files read back (a damaged one is skipped with a warning naming it and why).

    Raises:
        UsageError: a single run that is damaged, or none readable among several.
    """
    good: list[Path] = []
    for run_dir in run_dirs:
        try:
            load_run(run_dir)
        except UsageError as err:
            if len(run_dirs) == 1:
                raise
            log.warning("skipping run %s: %s", run_dir, err)
            continue
        good.append(run_dir)
    if not good:
        raise UsageError(f"none of the {len(run_dirs)} run directories is readable (see the warnings above)")
    return good


def _bench_groups(folder: Path) -> dict[str, list[Path]] | None:
    """The groups a `trainlab bench precision` output folder recorded (label -> run dirs), None for other folders."""
    path = folder / BENCH_MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
        groups = {str(label): [folder / str(d) for d in dirs] for label, dirs in manifest["groups"].items()}
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise UsageError(
            f"{path} is damaged ({first_line(err)}); delete it to report {folder} as a plain folder of runs"
        ) from None
    return groups


def plan_report(config: ReportConfig) -> ReportPlan:
    """Which runs (damaged ones skipped), grouped how, written where (see the module docstring).

    Raises:
        UsageError: no readable run.
    """
    if len(config.run_dirs) == 1 and (bench := _bench_groups(config.run_dirs[0])) is not None:
        folder = config.run_dirs[0]
        keep = readable_runs([d for dirs in bench.values() for d in dirs])
        groups = {label: [d for d in dirs if d in keep] for label, dirs in bench.items()}
        groups = {label: dirs for label, dirs in groups.items() if dirs}
        log.info("%s holds a `trainlab bench precision` report: updating it there", folder)
        return ReportPlan(keep, groups, config.out_dir or folder / "plots", config.out_dir or folder)
    run_dirs = readable_runs(config.expanded_run_dirs())
    if run_dirs != config.run_dirs:
        log.info("found %d run directories: %s", len(run_dirs), ", ".join(map(str, run_dirs)))
    if len(run_dirs) == 1:
        out_dir = config.out_dir or RunDir(run_dirs[0]).plots
        return ReportPlan(run_dirs, None, out_dir, out_dir)
    parent = config.run_dirs[0] if len(config.run_dirs) == 1 else None  # one folder searched: its report/
    out_dir = config.out_dir or (parent or Path(os.path.commonpath([p.resolve() for p in run_dirs]))) / "report"
    return ReportPlan(run_dirs, group_runs(run_dirs), out_dir, out_dir)


def write_report(plan: ReportPlan) -> list[Path]:
    """Draw the plots and write `results.md` / `results.csv` as `plan` says; returns the paths written."""
    from trainlab.report.plots import plot_comparison, plot_run  # matplotlib: only once the arguments are good

    differ = different_kinds([load_run(d) for d in plan.run_dirs]) if len(plan.run_dirs) > 1 else ""
    if differ:
        log.warning("comparing runs of different %s: their losses and metrics are not comparable", differ)
    if plan.groups is None:
        paths = plot_run(plan.run_dirs[0], plan.plots_dir)
        rows = [summarize_run(plan.run_dirs[0])]
    else:
        paths = plot_comparison(plan.groups, plan.plots_dir)
        rows = [summarize_run(run_dir, label) for label, dirs in plan.groups.items() for run_dir in dirs]
    md_path, csv_path = plan.tables_dir / "results.md", plan.tables_dir / "results.csv"
    write_results_table(rows, md_path, csv_path)
    return [*paths, md_path, csv_path]


def main(argv: list[str]) -> int:
    """Runs the report command; `argv` excludes the program and subcommand names. Returns the exit code."""
    config = parse(ReportConfig, argv, prog="trainlab report", epilog=__doc__ or "")
    plan = plan_report(config)
    for folder in dict.fromkeys([plan.plots_dir, plan.tables_dir]):
        check_output_path("--out-dir", folder, is_dir=True)
    for path in write_report(plan):
        print(path)
    return 0
