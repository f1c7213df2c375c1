"""Plots and result tables from run directories (`metrics.jsonl` + `config.yaml`).

`metrics.jsonl` holds one JSON object per line with "kind" ("train" | "eval" | "summary" | other kinds, ignored
here), "step" (optimizer step) and "epoch", plus numeric metrics. Conventions this module relies on:
- accuracies are fractions in [0, 1] (plots and tables show percent); a run whose accuracies exceed 1 is taken to
  be in percent already, with a warning;
- non-finite floats are stored as the strings "nan" / "inf" / "-inf" (JSON has no such numbers) and read back as
  floats;
- a resumed run appends to the same file, so steps logged after the last checkpoint appear twice: when the same
  (kind, step) or eval epoch occurs again, the later row wins.

Figures are built with the object-oriented `matplotlib.figure.Figure` API and written by the Agg canvas, so
nothing here touches pyplot's global state or needs a display.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from trainlab.errors import UsageError

log = logging.getLogger(__name__)

DPI = 120
ACCURACY_KEYS = ("test_accuracy", "accuracy")  # eval-row keys, first found wins
_NONFINITE = {
    "nan": math.nan,
    "NaN": math.nan,
    "inf": math.inf,
    "Infinity": math.inf,
    "-inf": -math.inf,
    "-Infinity": -math.inf,
}
_MIB = 2**20
_MEMORY_KIND_NAMES = {"cuda_max_allocated": "CUDA max allocated", "cpu_peak_rss": "CPU peak RSS"}


# ------------------------------------------------------------------------------------------------ reading


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """Reads `<run_dir>/metrics.jsonl`.

    Args:
        run_dir: a run directory written by `trainlab train`.

    Returns:
        The rows in file order (duplicates from resumed runs included), with "nan"/"inf" strings turned into floats.
        A truncated last line (a run killed mid-write) is skipped with a warning.

    Raises:
        UsageError: the directory or file is missing, a line is not a JSON object with a "kind", or the file is empty.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UsageError(f"run directory {run_dir} does not exist; pass a directory written by `trainlab train`")
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise UsageError(f"no metrics.jsonl in {run_dir}; pass a run directory written by `trainlab train`")
    lines = path.read_text(encoding="utf-8").splitlines()
    last_content = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    rows: list[dict[str, Any]] = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            if i == last_content:
                log.warning("%s: skipping truncated last line %d (%s)", path, i + 1, e.msg)
                continue
            raise UsageError(f"{path} line {i + 1} is not valid JSON ({e.msg}); fix or delete that line") from None
        if not isinstance(row, dict) or not isinstance(row.get("kind"), str):
            raise UsageError(f'{path} line {i + 1} is not a metrics row (a JSON object with a "kind")')
        rows.append({k: _NONFINITE.get(v, v) if isinstance(v, str) else v for k, v in row.items()})
    if not rows:
        raise UsageError(f"{path} has no rows yet; has the run logged anything?")
    return rows


def read_config(run_dir: str | Path) -> dict[str, Any]:
    """Reads `<run_dir>/config.yaml` (the resolved config); {} when there is none.

    Raises:
        UsageError: the file exists but is not a YAML mapping.
    """
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        return {}
    try:
        config = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise UsageError(f"{path} is not valid YAML ({type(e).__name__}); fix or delete it") from None
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise UsageError(f"{path} is not a YAML mapping")
    return config


def latest_rows(rows: Iterable[dict[str, Any]], kind: str, x_key: str) -> list[dict[str, Any]]:
    """Rows of one kind, one per `x_key` value (the last written wins), sorted by it."""
    by_x: dict[int, dict[str, Any]] = {}
    for row in rows:
        if row.get("kind") == kind and isinstance(row.get(x_key), (int, float)):
            by_x[int(row[x_key])] = row
    return [by_x[x] for x in sorted(by_x)]


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _series(rows: list[dict[str, Any]], key: str) -> tuple[np.ndarray, np.ndarray]:
    xs = [r["_x"] for r in rows if _is_number(r.get(key))]
    ys = [float(r[key]) for r in rows if _is_number(r.get(key))]
    return np.asarray(xs, dtype=np.int64), np.asarray(ys, dtype=np.float64)


@dataclass
class RunData:
    """What the plots and tables need from one run directory."""

    run_dir: Path
    precision: str | None
    seed: int | None
    model: str | None
    loss_steps: np.ndarray
    loss: np.ndarray
    eval_epochs: np.ndarray
    accuracy: np.ndarray  # fraction
    summary: dict[str, Any] = field(default_factory=dict)
    final_train_loss: float | None = None


def load_run(run_dir: str | Path) -> RunData:
    """Reads one run directory into the series and summary numbers used by the plots and tables."""
    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    config = read_config(run_dir)
    train = [{**r, "_x": r["step"]} for r in latest_rows(rows, "train", "step")]
    evals = [{**r, "_x": r["epoch"]} for r in latest_rows(rows, "eval", "epoch")]
    summaries = [r for r in rows if r["kind"] == "summary"]
    summary = dict(summaries[-1]) if summaries else {}
    loss_steps, loss = _series(train, "loss")
    acc_key = next((k for k in ACCURACY_KEYS if any(_is_number(r.get(k)) for r in evals)), ACCURACY_KEYS[0])
    eval_epochs, accuracy = _series(evals, acc_key)
    summary_acc = {k: summary[k] for k in ("final_" + acc_key, "best_" + acc_key) if _is_number(summary.get(k))}
    if np.any(accuracy > 1.0) or any(v > 1.0 for v in summary_acc.values()):
        log.warning("%s: accuracies above 1, reading them as percent", run_dir)
        accuracy = accuracy / 100.0
        summary_acc = {k: v / 100.0 for k, v in summary_acc.items()}
    summary["final_test_accuracy"] = summary_acc.get("final_" + acc_key, float(accuracy[-1]) if len(accuracy) else None)
    summary["best_test_accuracy"] = summary_acc.get("best_" + acc_key, float(accuracy.max()) if len(accuracy) else None)
    final_train_loss = None
    last_epoch = max((int(r["epoch"]) for r in train if _is_number(r.get("epoch"))), default=None)
    if last_epoch is not None:
        last = [float(r["loss"]) for r in train if r.get("epoch") == last_epoch and _is_number(r.get("loss"))]
        final_train_loss = float(np.mean(last)) if last else None  # nan if the run diverged: keep it visible
    precision = summary.get("precision") or config.get("precision")
    seed = config.get("seed")
    model = config.get("model")
    return RunData(
        run_dir=run_dir,
        precision=str(precision) if precision is not None else None,
        seed=int(seed) if isinstance(seed, int) else None,
        model=str(model) if model is not None else None,
        loss_steps=loss_steps,
        loss=loss,
        eval_epochs=eval_epochs,
        accuracy=accuracy,
        summary=summary,
        final_train_loss=final_train_loss,
    )


def summarize_run(run_dir: str | Path, label: str | None = None) -> dict[str, Any]:
    """One row for `write_results_table`.

    Args:
        run_dir: the run directory.
        label: the group this run belongs to (runs sharing a label are seeds of one configuration); defaults to
            the run's precision, else the directory name.

    Returns:
        A dict with keys: label, run_dir, precision, seed, final_test_accuracy, best_test_accuracy (fractions),
        final_train_loss (mean loss of the logged steps of the last epoch), peak_memory_bytes, memory_kind,
        cuda_max_reserved_bytes, seconds_per_epoch, images_per_second (None where the run did not record it).
    """
    return _summary_row(load_run(run_dir), label)


def _summary_row(run: RunData, label: str | None) -> dict[str, Any]:
    s = run.summary
    return {
        "label": label or run.precision or run.run_dir.name,
        "run_dir": str(run.run_dir),
        "precision": run.precision,
        "seed": run.seed,
        "final_test_accuracy": s.get("final_test_accuracy"),
        "best_test_accuracy": s.get("best_test_accuracy"),
        "final_train_loss": run.final_train_loss,
        "peak_memory_bytes": s.get("peak_memory_bytes"),
        "memory_kind": s.get("memory_kind"),
        "cuda_max_reserved_bytes": s.get("cuda_max_reserved_bytes"),
        "cpu_peak_rss_growth_bytes": s.get("cpu_peak_rss_growth_bytes"),
        "seconds_per_epoch": s.get("seconds_per_epoch"),
        "images_per_second": s.get("images_per_second"),
    }


# ------------------------------------------------------------------------------------------------ helpers


def _new_figure(title: str, xlabel: str, ylabel: str) -> tuple[Figure, Axes]:
    fig = Figure(figsize=(8, 5), layout="constrained")
    ax = fig.add_subplot()
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    return fig, ax


def _save(fig: Figure, out_dir: Path, name: str) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / name
    fig.savefig(path, dpi=DPI)
    return path


def _smooth(x: np.ndarray, y: np.ndarray, window: int) -> tuple[np.ndarray, np.ndarray]:
    """Trailing moving average; returns the x of each window's last point."""
    if window <= 1 or len(y) < window:
        return x, y
    kernel = np.ones(window) / window
    return x[window - 1 :], np.convolve(y, kernel, mode="valid")


def _mean_band(xs: list[np.ndarray], ys: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Mean, min and max over runs at the x values every run has."""
    common = xs[0]
    for x in xs[1:]:
        common = np.intersect1d(common, x)
    stacked = np.stack([y[np.searchsorted(x, common)] for x, y in zip(xs, ys)])
    return common, stacked.mean(0), stacked.min(0), stacked.max(0)


def _tail_inset(
    ax: Axes, lines: list[tuple[np.ndarray, np.ndarray, str]], x_from: float, *, log_y: bool, upper: bool
) -> None:
    """Zoomed inset (upper or lower right) over x >= x_from, y-limits fitted to the data shown."""
    visible = [(x[x >= x_from], y[x >= x_from], color) for x, y, color in lines]
    visible = [(x, y, c) for x, y, c in visible if len(x)]
    values = np.concatenate([y for _, y, _ in visible]) if visible else np.empty(0)
    values = values[np.isfinite(values)]
    if log_y:
        values = values[values > 0]
    if len(values) == 0:
        return
    lo, hi = float(values.min()), float(values.max())
    everything = np.concatenate([y[np.isfinite(y)] for _, y, _ in lines])
    if hi - lo <= 1e-9 * max(abs(hi), 1.0) or hi - lo >= 0.5 * float(everything.max() - everything.min()):
        return  # a flat tail, or one already spread over half the axis: a zoom would show nothing new
    inset = ax.inset_axes((0.52, 0.5 if upper else 0.1, 0.45, 0.38))
    for x, y, color in visible:
        inset.plot(x, y, color=color, linewidth=1.0)
    if log_y:
        inset.set_yscale("log")
        inset.set_ylim(lo / 1.15, hi * 1.15)
    else:
        pad = max(hi - lo, 1e-3 * max(abs(hi), 1.0)) * 0.1
        inset.set_ylim(lo - pad, hi + pad)
    inset.set_xlim(x_from, max(float(x.max()) for x, _, _ in visible))
    inset.tick_params(labelsize=7)
    inset.grid(True, alpha=0.3)
    inset.set_title("zoom: tail", fontsize=8)
    ax.indicate_inset_zoom(inset, edgecolor="0.5")


def _legend(ax: Axes) -> None:
    """A legend beside the axes (never over the data); nothing when no artist has a label."""
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, borderaxespad=0.0)


def _finite(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    keep = np.isfinite(y)
    return x[keep], y[keep]


# ------------------------------------------------------------------------------------------------ single run


def plot_run(run_dir: str | Path, out_dir: str | Path) -> list[Path]:
    """Training loss vs step and test accuracy vs epoch for one run.

    Args:
        run_dir: the run directory.
        out_dir: where to write `loss.png` and (when the run has eval rows) `accuracy.png`.

    Returns:
        The paths written.

    Raises:
        UsageError: the run directory is unusable or has no training loss logged.
    """
    run = load_run(run_dir)
    name = Path(run_dir).name
    out_dir = Path(out_dir)
    if not len(run.loss):
        raise UsageError(f"{run_dir}/metrics.jsonl has no training loss yet; nothing to plot")
    paths = []
    fig, ax = _new_figure(f"Training loss: {name}", "optimizer step", "training loss (cross-entropy)")
    x, y = _finite(run.loss_steps, run.loss)
    ax.plot(x, y, color="C0", label=f"{run.precision or name}")
    if len(y) and np.all(y > 0):
        ax.set_yscale("log")
    if len(y) < len(run.loss):
        ax.set_title(f"Training loss: {name} ({len(run.loss) - len(y)} non-finite values not shown)")
    ax.legend()
    paths.append(_save(fig, out_dir, "loss.png"))
    if len(run.accuracy):
        fig, ax = _new_figure(f"Test accuracy: {name}", "epoch", "test accuracy (%)")
        ax.plot(run.eval_epochs, 100 * run.accuracy, marker="o", markersize=3, color="C1", label=run.precision or name)
        ax.legend()
        paths.append(_save(fig, out_dir, "accuracy.png"))
    return paths


# ------------------------------------------------------------------------------------------------ comparison


def _as_groups(run_dirs: Mapping[str, Path | str | Sequence[Path | str]]) -> dict[str, list[RunData]]:
    if not run_dirs:
        raise UsageError("no run directories to compare")
    groups: dict[str, list[RunData]] = {}
    for label, dirs in run_dirs.items():
        paths = [dirs] if isinstance(dirs, (str, os.PathLike)) else list(dirs)
        if not paths:
            raise UsageError(f"no run directories for {label!r}")
        groups[label] = [load_run(p) for p in paths]
    return groups


def group_runs(run_dirs: Sequence[str | Path]) -> dict[str, list[Path]]:
    """Groups run directories that differ only in their seed, labelled by precision (plus model if ambiguous).

    Runs are grouped by their config with seed and bookkeeping fields (run_dir, resume, logging options) removed.

    Returns:
        label -> run directories, in first-seen order; suitable for `plot_comparison`.
    """
    ignored = {
        "seed",
        "run_dir",
        "resume",
        "wandb",
        "tensorboard",
        "progress",
        "num_workers",
        "log_every",
        "checkpoint_every",
        "memory_snapshot",
    }
    keyed: dict[str, list[Path]] = {}
    info: dict[str, tuple[str, str | None]] = {}
    for run_dir in map(Path, run_dirs):
        config = read_config(run_dir)
        run = load_run(run_dir)
        identity = {k: v for k, v in config.items() if k not in ignored} if config else {"dir": str(run_dir)}
        key = json.dumps(identity, sort_keys=True, default=str)
        keyed.setdefault(key, []).append(run_dir)
        info.setdefault(key, (run.precision or run_dir.name, run.model))
    base_labels = [precision for precision, _ in info.values()]
    groups: dict[str, list[Path]] = {}
    for i, (key, dirs) in enumerate(keyed.items()):
        precision, model = info[key]
        label = precision
        if base_labels.count(precision) > 1:
            label = f"{model} {precision}" if model else precision
        if label in groups:
            label = f"{label} #{i + 1}"
        groups[label] = dirs
    return groups


def plot_comparison(run_dirs: Mapping[str, Path | str | Sequence[Path | str]], out_dir: str | Path) -> list[Path]:
    """The precision-lab figures: one curve / bar / colour per configuration, seeds aggregated.

    Writes `loss_vs_step.png` (all modes overlaid, zoomed inset on the last 10% of steps), `accuracy_vs_epoch.png`
    (inset on the last epochs), `memory.png` (peak memory bars), `time_per_epoch.png` and `accuracy_vs_time.png`.
    With several seeds per configuration, curves show the mean with a min-max band, bars the mean with a
    standard-deviation error bar.

    Args:
        run_dirs: legend label (e.g. "bf16-amp") -> one run directory, or a list of run directories that are seeds
            of the same configuration.
        out_dir: output directory (created).

    Returns:
        The paths written.

    Raises:
        UsageError: a run directory is missing or unreadable.
    """
    groups = _as_groups(run_dirs)
    out_dir = Path(out_dir)
    colors = {label: f"C{i % 10}" for i, label in enumerate(groups)}
    return [
        _plot_loss_comparison(groups, colors, out_dir),
        _plot_accuracy_comparison(groups, colors, out_dir),
        _plot_summary_bars(groups, colors, out_dir, _memory_key(groups), "memory.png"),
        _plot_summary_bars(groups, colors, out_dir, "seconds_per_epoch", "time_per_epoch.png"),
        _plot_accuracy_vs_time(groups, colors, out_dir),
    ]


def _group_curve(
    runs: list[RunData], x_attr: str, y_attr: str, *, smooth: int = 1, scale: float = 1.0
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    xs, ys = [], []
    for run in runs:
        x, y = _finite(getattr(run, x_attr), getattr(run, y_attr) * scale)
        x, y = _smooth(x, y, smooth)
        if len(x):
            xs.append(x)
            ys.append(y)
    if not xs:
        return None
    x, mean, lo, hi = _mean_band(xs, ys)
    if not len(x):  # runs logged at disjoint x values: show the longest one alone rather than nothing
        longest = max(range(len(xs)), key=lambda i: len(xs[i]))
        return xs[longest], ys[longest], ys[longest], ys[longest]
    return x, mean, lo, hi


def _seed_note(runs: list[RunData]) -> str:
    return f" (mean of {len(runs)} seeds)" if len(runs) > 1 else ""


def _plot_loss_comparison(groups: dict[str, list[RunData]], colors: dict[str, str], out_dir: Path) -> Path:
    num_points = max((len(r.loss) for runs in groups.values() for r in runs), default=0)
    window = max(1, num_points // 100) if num_points > 200 else 1
    ylabel = "training loss" + (f" (moving average over {window} logged steps)" if window > 1 else "")
    fig, ax = _new_figure("Training loss by precision mode", "optimizer step", ylabel)
    lines, all_y = [], []
    for label, runs in groups.items():
        curve = _group_curve(runs, "loss_steps", "loss", smooth=window)
        if curve is None:
            ax.plot([], [], color=colors[label], label=f"{label} (no finite loss)")
            continue
        x, mean, lo, hi = curve
        ax.plot(x, mean, color=colors[label], linewidth=1.2, label=label + _seed_note(runs))
        if len(runs) > 1:
            ax.fill_between(x, lo, hi, color=colors[label], alpha=0.2, linewidth=0)
        lines.append((x, mean, colors[label]))
        all_y.append(mean)
    log_y = bool(all_y) and bool(np.all(np.concatenate(all_y) > 0))
    if log_y:
        ax.set_yscale("log")
    if lines:
        x_max = max(float(x.max()) for x, _, _ in lines)
        x_min = min(float(x.min()) for x, _, _ in lines)
        if x_max > x_min:
            _tail_inset(ax, lines, x_max - 0.1 * (x_max - x_min), log_y=log_y, upper=True)  # loss falls
    _legend(ax)
    return _save(fig, out_dir, "loss_vs_step.png")


def _plot_accuracy_comparison(groups: dict[str, list[RunData]], colors: dict[str, str], out_dir: Path) -> Path:
    fig, ax = _new_figure("Test accuracy by precision mode", "epoch", "test accuracy (%)")
    lines = []
    for label, runs in groups.items():
        curve = _group_curve(runs, "eval_epochs", "accuracy", scale=100.0)
        if curve is None:
            ax.plot([], [], color=colors[label], label=f"{label} (no eval)")
            continue
        x, mean, lo, hi = curve
        ax.plot(x, mean, color=colors[label], marker="o", markersize=2.5, linewidth=1.2, label=label + _seed_note(runs))
        if len(runs) > 1:
            ax.fill_between(x, lo, hi, color=colors[label], alpha=0.2, linewidth=0)
        lines.append((x, mean, colors[label]))
    if lines:
        last_epoch = max(int(x.max()) for x, _, _ in lines)
        tail = max(3, math.ceil(0.1 * last_epoch))
        if last_epoch >= 2 * tail:
            _tail_inset(ax, lines, last_epoch - tail, log_y=False, upper=False)  # accuracy rises
    _legend(ax)
    return _save(fig, out_dir, "accuracy_vs_epoch.png")


def _values(runs: list[RunData], key: str) -> list[float]:
    return [float(r.summary[key]) for r in runs if _is_number(r.summary.get(key))]


def _mean_std(values: Sequence[float]) -> tuple[float, float | None]:
    """Mean and sample standard deviation (ddof=1; None for fewer than two values)."""
    mean = float(np.mean(values))
    return mean, (float(np.std(values, ddof=1)) if len(values) > 1 else None)


def _memory_key(groups: dict[str, list[RunData]]) -> str:
    """On CPU the RSS high-water mark is mostly the interpreter and libraries: plot its growth during training."""
    runs = [r for rs in groups.values() for r in rs]
    if runs and all(r.summary.get("cpu_peak_rss_growth_bytes") is not None for r in runs):
        return "cpu_peak_rss_growth_bytes"
    return "peak_memory_bytes"


def _plot_summary_bars(
    groups: dict[str, list[RunData]], colors: dict[str, str], out_dir: Path, key: str, filename: str
) -> Path:
    if key == "cpu_peak_rss_growth_bytes":
        title, ylabel, scale, fmt = (
            "Peak RSS growth during training (CPU)",
            "peak RSS - RSS at start (MiB)",
            1 / _MIB,
            "{:.0f}",
        )
    elif key == "peak_memory_bytes":
        kinds = sorted(
            {
                str(r.summary.get("memory_kind"))
                for runs in groups.values()
                for r in runs
                if r.summary.get("memory_kind")
            }
        )
        kind_text = ", ".join(_MEMORY_KIND_NAMES.get(k, k) for k in kinds) or "kind not recorded"
        title, ylabel, scale, fmt = f"Peak memory ({kind_text})", "peak memory (MiB)", 1 / _MIB, "{:.0f}"
    else:
        title, ylabel, scale, fmt = (
            "Training time per epoch",
            "train time per epoch (s, first epoch excluded)",
            1.0,
            "{:.2f}",
        )
    fig, ax = _new_figure(title, "precision mode", ylabel)
    labels = list(groups)
    positions = np.arange(len(labels))
    has_reserved = key == "peak_memory_bytes" and any(
        _values(runs, "cuda_max_reserved_bytes") for runs in groups.values()
    )
    width = 0.4 if has_reserved else 0.7
    for i, label in enumerate(labels):
        values = [v * scale for v in _values(groups[label], key)]
        if not values:
            ax.text(i, 0, "n/a", ha="center", va="bottom", fontsize=8)
            continue
        mean, std = _mean_std(values)
        x = i - width / 2 if has_reserved else i
        ax.bar(x, mean, width, yerr=std, capsize=4, color=colors[label], label=label + _seed_note(groups[label]))
        ax.annotate(
            fmt.format(mean),
            (x, mean + (std or 0.0)),
            ha="center",
            va="bottom",
            fontsize=8,
            xytext=(0, 2),
            textcoords="offset points",
        )
        if has_reserved:
            reserved = [v / _MIB for v in _values(groups[label], "cuda_max_reserved_bytes")]
            if reserved:
                r_mean, r_std = _mean_std(reserved)
                ax.bar(
                    i + width / 2,
                    r_mean,
                    width,
                    yerr=r_std,
                    capsize=4,
                    color=colors[label],
                    alpha=0.45,
                    hatch="//",
                    label="CUDA max reserved" if i == 0 else None,
                )
    ax.set_xticks(positions, labels, rotation=20, ha="right")
    ax.margins(y=0.12)  # room for the value labels above the bars
    _legend(ax)
    return _save(fig, out_dir, filename)


def _plot_accuracy_vs_time(groups: dict[str, list[RunData]], colors: dict[str, str], out_dir: Path) -> Path:
    fig, ax = _new_figure(
        "Final test accuracy vs training time",
        "train time per epoch (s, first epoch excluded)",
        "final test accuracy (%)",
    )
    all_accuracies: list[float] = []
    for label, runs in groups.items():
        points = [
            (float(r.summary["seconds_per_epoch"]), 100 * float(r.summary["final_test_accuracy"]))
            for r in runs
            if _is_number(r.summary.get("seconds_per_epoch")) and _is_number(r.summary.get("final_test_accuracy"))
        ]
        if not points:
            ax.scatter([], [], color=colors[label], label=f"{label} (no summary)")
            continue
        xs, ys = zip(*points)
        all_accuracies += ys
        ax.scatter(
            xs, ys, color=colors[label], s=36, label=label + (f" ({len(points)} seeds)" if len(points) > 1 else "")
        )
    if all_accuracies:  # accuracy cannot exceed 100%: do not let the autoscale pad past it
        lo, hi = min(all_accuracies), max(all_accuracies)
        pad = max(0.5, 0.08 * (hi - lo))
        ax.set_ylim(max(0.0, lo - pad), min(100.0, hi) + min(pad, 100.5 - min(100.0, hi)))
    _legend(ax)
    return _save(fig, out_dir, "accuracy_vs_time.png")


# ------------------------------------------------------------------------------------------------ tables


def _fmt(values: Sequence[float], fmt: str, n_runs: int) -> str:
    if not values:
        return "n/a"
    mean, std = _mean_std(values)
    text = fmt.format(mean) + (f" ± {fmt.format(std)}" if std is not None else "")
    if len(values) < n_runs:
        text += f" ({len(values)} of {n_runs} runs)"
    return text


def _numbers(rows: list[dict[str, Any]], key: str, scale: float = 1.0) -> list[float]:
    return [float(r[key]) * scale for r in rows if _is_number(r.get(key))]


def write_results_table(rows: list[dict[str, Any]], md_path: str | Path, csv_path: str | Path) -> None:
    """Writes the precision-lab results table as markdown and CSV, one line per configuration.

    Rows sharing a "label" (default: their "precision") are seeds of one configuration and are aggregated as
    mean ± sample standard deviation (ddof=1; the ± part is omitted for a single seed). Missing numbers show as
    "n/a" (markdown) or empty cells (CSV), and "(k of n runs)" marks a mean over fewer runs than the group has.

    Args:
        rows: one dict per run, as returned by `summarize_run` (keys: label, precision, seed, final_test_accuracy,
            best_test_accuracy, final_train_loss, peak_memory_bytes, memory_kind, seconds_per_epoch,
            images_per_second; accuracies as fractions).
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
    md_header = [
        first_header,
        "seed(s)",
        "final test acc. (%)",
        "best test acc. (%, extra)",
        "final train loss",
        "peak memory (MiB)",
        "CPU RSS growth (MiB)",
        "memory kind",
        "s/epoch",
        "images/s",
    ]
    md_lines = ["| " + " | ".join(md_header) + " |", "|" + "---|" * len(md_header)]
    csv_rows = []
    for label, group in groups.items():
        n = len(group)
        seeds = [r.get("seed") for r in group]
        seed_text = ", ".join(str(s) for s in seeds) if all(s is not None for s in seeds) else f"{n} runs"
        kinds = sorted({str(r["memory_kind"]) for r in group if r.get("memory_kind")})
        columns = {
            "final_test_accuracy_pct": (_numbers(group, "final_test_accuracy", 100.0), "{:.2f}"),
            "best_test_accuracy_pct": (_numbers(group, "best_test_accuracy", 100.0), "{:.2f}"),
            "final_train_loss": (_numbers(group, "final_train_loss"), "{:.4g}"),
            "peak_memory_mib": (_numbers(group, "peak_memory_bytes", 1 / _MIB), "{:.0f}"),
            "cpu_rss_growth_mib": (_numbers(group, "cpu_peak_rss_growth_bytes", 1 / _MIB), "{:.0f}"),
            "seconds_per_epoch": (_numbers(group, "seconds_per_epoch"), "{:.2f}"),
            "images_per_second": (_numbers(group, "images_per_second"), "{:.0f}"),
        }
        cells = [_fmt(values, fmt, n) for values, fmt in columns.values()]
        md_cells = [label, seed_text, *cells[:5], ", ".join(kinds) or "n/a", *cells[5:]]
        md_lines.append("| " + " | ".join(md_cells) + " |")
        csv_row: dict[str, Any] = {
            first_header: label,
            "num_seeds": n,
            "seeds": ";".join("" if s is None else str(s) for s in seeds),
        }
        for name, (values, _fmt_str) in columns.items():
            mean, std = _mean_std(values) if values else (None, None)
            csv_row[f"{name}_mean"] = "" if mean is None else mean
            csv_row[f"{name}_std"] = "" if std is None else std
            csv_row[f"{name}_count"] = len(values)
        csv_row["memory_kind"] = ";".join(kinds)
        csv_rows.append(csv_row)

    md_lines += [
        "",
        "Final = test accuracy after the last epoch. Best = maximum over epochs, i.e. selected on the test set "
        "(optimistic; shown only for comparison with tables that report it). Final train loss = mean training loss "
        "of the logged steps of the last epoch. mean ± sample std (ddof=1) over seeds. s/epoch and images/s time "
        "the training loop only and exclude the first epoch.",
    ]
    md_path, csv_path = Path(md_path), Path(csv_path)
    md_path.parent.mkdir(parents=True, exist_ok=True)
    md_path.write_text("\n".join(md_lines) + "\n", encoding="utf-8")
    csv_path.parent.mkdir(parents=True, exist_ok=True)
    with open(csv_path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(csv_rows[0]))
        writer.writeheader()
        writer.writerows(csv_rows)
