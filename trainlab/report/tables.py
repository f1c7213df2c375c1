"""The results table: one line per configuration (seeds aggregated as mean ± std), as markdown and CSV.

Rows come from `trainlab.report.runs.summarize_run`; accuracies are fractions there and percent here.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from trainlab.errors import UsageError
from trainlab.report.runs import ACCURACY_KEYS, is_number

MIB = 2**20  # bytes per mebibyte


def mean_std(values: Sequence[float]) -> tuple[float, float | None]:
    """Mean and sample standard deviation (ddof=1; None for fewer than two values)."""
    mean = float(np.mean(values))
    return mean, (float(np.std(values, ddof=1)) if len(values) > 1 else None)


def timing_note(first_epoch_timed: Sequence[bool | None]) -> str:
    """How per-epoch times were measured, for a label: whether they leave out the first (warm-up) epoch.

    Args:
        first_epoch_timed: per run, whether its timing includes its first epoch (a one-epoch run), None if unknown.
    """
    known = [flag for flag in first_epoch_timed if flag is not None]
    if known and all(known) and len(known) == len(first_epoch_timed):
        return "first epoch included: one epoch per run"
    if known and not any(known) and len(known) == len(first_epoch_timed):
        return "first epoch excluded"
    if any(known):
        return "first epoch excluded, except in runs of one epoch"
    return "first epoch excluded when a run trained more than one"


def _fmt(values: Sequence[float], fmt: str, n_runs: int) -> str:
    if not values:
        return "n/a"
    mean, std = mean_std(values)
    text = fmt.format(mean) + (f" ± {fmt.format(std)}" if std is not None else "")
    if len(values) < n_runs:
        text += f" ({len(values)} of {n_runs} runs)"
    return text


def _numbers(rows: list[dict[str, Any]], key: str, scale: float = 1.0) -> list[float]:
    return [float(r[key]) * scale for r in rows if is_number(r.get(key))]


def _loss_steps_note(group: list[dict[str, Any]]) -> str:
    steps = sorted({int(r["final_train_loss_step"]) for r in group if is_number(r.get("final_train_loss_step"))})
    if not steps or not _numbers(group, "final_train_loss"):
        return ""
    return f" (step {steps[0]})" if len(steps) == 1 else f" (steps {steps[0]}-{steps[-1]})"


def _timed_note(group: list[dict[str, Any]], cell: str) -> str:
    timed = sorted({int(r["epochs_timed"]) for r in group if is_number(r.get("epochs_timed"))})
    if not timed or cell == "n/a":
        return ""
    n = str(timed[0]) if len(timed) == 1 else f"{timed[0]}-{timed[-1]}"
    first = " incl. the first" if any(r.get("first_epoch_timed") is True for r in group) else ""
    return f" (n={n} epoch{'' if timed == [1] else 's'}{first})"


@contextmanager
def replaced_when_written(path: Path) -> Iterator[Path]:
    """A temporary name beside `path` to write to; renamed onto `path` once written whole (a reader never sees half a
    table, and whatever was at `path`, a FIFO included, is replaced instead of opened); removed on failure."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_results_table(rows: list[dict[str, Any]], md_path: str | Path, csv_path: str | Path) -> None:
    """Writes the precision-lab results table as markdown and CSV, one line per configuration.

    Rows sharing a "label" (default: their "precision") are seeds of one configuration and are aggregated as
    mean ± sample standard deviation (ddof=1; the ± part is omitted for a single seed). Missing numbers show as
    "n/a" (markdown) or empty cells (CSV), and "(k of n runs)" marks a mean over fewer runs than the group has.

    Args:
        rows: one dict per run, as returned by `summarize_run` (keys: label, precision, seed, final_test_accuracy,
            best_test_accuracy, final_train_loss, peak_memory_bytes, memory_kind, seconds_per_epoch,
            images_per_second, achieved_tflops, mfu; accuracies as fractions).
        md_path: markdown output path.
        csv_path: CSV output path.

    Raises:
        UsageError: `rows` is empty.
    """
    if not rows:
        raise UsageError("no runs to tabulate")
    groups: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(str(row.get("label") or row.get("precision") or row.get("run_dir")), []).append(row)

    first_header = (
        "precision" if all(label == g[0].get("precision") for label, g in groups.items()) else "configuration"
    )
    # accuracy columns for runs that measure accuracy (CIFAR); the tracked metric for the others (VAR, tokenizer)
    with_accuracy = any(is_number(r.get(k)) for r in rows for k in ("final_test_accuracy", "best_test_accuracy"))
    other_metric = any(r.get("eval_metric") and r.get("eval_metric") not in ACCURACY_KEYS for r in rows)
    metric_header = ["final eval metric", "best eval metric"] if other_metric else []
    accuracy_header = ["final test acc. (%)", "best test acc. (%, extra)"] if with_accuracy or not other_metric else []
    md_header = [
        first_header,
        "seed(s)",
        *accuracy_header,
        *metric_header,
        "final train loss",
        "peak memory (MiB)",
        "CPU RSS growth (MiB)",
        "memory kind",
        "s/epoch",
        "images/s",
        "TFLOP/s per device",
        "MFU (%)",
    ]
    md_lines = ["| " + " | ".join(md_header) + " |", "|" + "---|" * len(md_header)]
    csv_rows = []
    for label, group in groups.items():
        n = len(group)
        seeds = [r.get("seed") for r in group]
        seed_text = ", ".join(str(s) for s in seeds) if all(s is not None for s in seeds) else f"{n} runs"
        kinds = sorted({str(r["memory_kind"]) for r in group if r.get("memory_kind")})
        columns: dict[str, tuple[list[float], str]] = {}
        if accuracy_header:
            columns["final_test_accuracy_pct"] = (_numbers(group, "final_test_accuracy", 100.0), "{:.2f}")
            columns["best_test_accuracy_pct"] = (_numbers(group, "best_test_accuracy", 100.0), "{:.2f}")
        if metric_header:
            columns["final_eval"] = (_numbers(group, "final_eval"), "{:.4g}")
            columns["best_eval"] = (_numbers(group, "best_eval"), "{:.4g}")
        columns |= {
            "final_train_loss": (_numbers(group, "final_train_loss"), "{:.4g}"),
            "peak_memory_mib": (_numbers(group, "peak_memory_bytes", 1 / MIB), "{:.0f}"),
            "cpu_rss_growth_mib": (_numbers(group, "cpu_peak_rss_growth_bytes", 1 / MIB), "{:.0f}"),
            "seconds_per_epoch": (_numbers(group, "seconds_per_epoch"), "{:.2f}"),
            "images_per_second": (_numbers(group, "images_per_second"), "{:.0f}"),
            "achieved_tflops": (_numbers(group, "achieved_tflops"), "{:.3g}"),
            "mfu_pct": (_numbers(group, "mfu", 100.0), "{:.1f}"),
        }
        cells = {name: _fmt(values, fmt, n) for name, (values, fmt) in columns.items()}
        metric_names = sorted({str(r["eval_metric"]) for r in group if r.get("eval_metric")})
        for name in ("final_eval", "best_eval"):
            if name in cells and cells[name] != "n/a":
                cells[name] = f"{'/'.join(metric_names)} {cells[name]}"
        cells["final_train_loss"] += _loss_steps_note(group)
        cells["seconds_per_epoch"] += _timed_note(group, cells["seconds_per_epoch"])
        ordered = list(cells.values())
        split = len(ordered) - 4  # memory kind goes before s/epoch, images/s, TFLOP/s and MFU
        md_cells = [label, seed_text, *ordered[:split], ", ".join(kinds) or "n/a", *ordered[split:]]
        md_lines.append("| " + " | ".join(md_cells) + " |")
        csv_row: dict[str, Any] = {
            first_header: label,
            "num_seeds": n,
            "seeds": ";".join("" if s is None else str(s) for s in seeds),
        }
        for name, (values, _fmt_str) in columns.items():
            mean, std = mean_std(values) if values else (None, None)
            csv_row[f"{name}_mean"] = "" if mean is None else mean
            csv_row[f"{name}_std"] = "" if std is None else std
            csv_row[f"{name}_count"] = len(values)
        csv_row["memory_kind"] = ";".join(kinds)
        csv_rows.append(csv_row)

    md_lines += [
        "",
        "Final = test accuracy (or the recipe's tracked evaluation metric) after the last epoch. Best = the best "
        "over epochs, i.e. selected on the evaluation set (optimistic; shown only for comparison with tables that "
        "report it). Final train loss = the training loss at the last logged step (its step in brackets). "
        "mean ± sample std (ddof=1) over seeds. s/epoch, images/s, TFLOP/s and MFU time the training loop only ("
        f"{timing_note([r.get('first_epoch_timed') for r in rows])}); n = the number of epochs timed.",
    ]
    md_path, csv_path = Path(md_path), Path(csv_path)
    with replaced_when_written(md_path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.write("\n".join(md_lines) + "\n")
    with replaced_when_written(csv_path) as tmp, open(tmp, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(csv_rows[0]))
        writer.writeheader()
        writer.writerows(csv_rows)
