"""The report figures: one run (loss vs step, accuracy vs epoch, training health) or the precision-lab comparison.

Inputs come from `trainlab.report.runs` (one `RunData` per run directory). Figures are built with the
object-oriented `matplotlib.figure.Figure` API and written by the Agg canvas, so nothing here touches pyplot's global
state or needs a display.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.text import Text
from matplotlib.ticker import MaxNLocator

from trainlab.engine.run_dir import RunDir
from trainlab.errors import UsageError, printable
from trainlab.report.runs import RunData, is_number, latest_rows, load_run
from trainlab.report.tables import MIB, mean_std, replaced_when_written, timing_note

DPI = 120
MARKERS_UP_TO = 60  # curves with at most this many points show each point (a 1-point "line" is otherwise invisible)
_LINESTYLES = ("-", "--", ":", "-.")
_MEMORY_KIND_NAMES = {"cuda_max_allocated": "CUDA max allocated", "cpu_peak_rss": "CPU peak RSS"}


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
    for text in fig.findobj(Text):  # a folder name's undecodable bytes cannot be drawn: shown as \xff instead
        text.set_text(printable(text.get_text()))
    with replaced_when_written(path) as tmp:
        fig.savefig(tmp, dpi=DPI, format="png")
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
    """Zoomed inset (upper or lower right) over x >= x_from, y-limits fitted to the data shown.

    The tail always holds at least the last two logged x values (a one-point tail draws nothing: a line needs two
    points), and curves with few points show markers, as on the main axes. No inset when there are fewer than three
    x values in all: the zoom would be the whole curve.
    """
    distinct = np.unique(np.concatenate([x for x, _, _ in lines])) if lines else np.empty(0)
    if len(distinct) < 3:
        return
    x_from = min(x_from, float(distinct[-2]))
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
        inset.plot(x, y, color=color, linewidth=1.0, **_marker(len(x)))
    if log_y:
        inset.set_yscale("log")
        inset.set_ylim(lo / 1.15, hi * 1.15)
    else:
        pad = max(hi - lo, 1e-3 * max(abs(hi), 1.0)) * 0.1
        inset.set_ylim(lo - pad, hi + pad)
    x_to = max(float(x.max()) for x, _, _ in visible)
    x_pad = 0.04 * (x_to - x_from)  # markers at the edges stay whole
    inset.set_xlim(x_from - x_pad, x_to + x_pad)
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


def _integer_x(ax: Axes) -> None:
    """Ticks at whole steps / epochs only (never 1.2, 1.4)."""
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _marker(num_points: int) -> dict[str, Any]:
    return {"marker": "o", "markersize": 3.5} if num_points <= MARKERS_UP_TO else {}


def _same_as(curves: dict[str, tuple[np.ndarray, np.ndarray]]) -> dict[str, str]:
    """label -> the earlier label whose curve has exactly the same points (drawn on top of each other)."""
    same: dict[str, str] = {}
    labels = list(curves)
    for i, label in enumerate(labels):
        x, y = curves[label]
        for earlier in labels[:i]:
            ex, ey = curves[earlier]
            if earlier not in same and np.array_equal(x, ex) and np.allclose(y, ey, rtol=1e-9, atol=0.0):
                same[label] = earlier
                break
    return same


def _eval_axis(runs: list[RunData]) -> tuple[str, str, float] | None:
    """(RunData attribute pair prefix, axis label, scale) of the evaluation curve: test accuracy in percent when the
    runs measure it, else their tracked metric (VAR's validation cross-entropy, the tokenizer's PSNR)."""
    if any(len(r.accuracy) for r in runs):
        return "accuracy", "test accuracy (%)", 100.0
    names = sorted({r.eval_metric for r in runs if r.eval_metric and len(r.metric)})
    if names:
        return "metric", " / ".join(names), 1.0
    return None


# ------------------------------------------------------------------------------------------------ single run


def plot_run(run_dir: str | Path, out_dir: str | Path) -> list[Path]:
    """Training loss vs step and test accuracy vs epoch for one run, and its training health when it logged any.

    Args:
        run_dir: the run directory.
        out_dir: where to write `loss.png`, (when the run has eval rows) `accuracy.png` and (when it has health rows,
            `--health-every`) `health.png`.

    Returns:
        The paths written.

    Raises:
        UsageError: the run directory is unusable or has no training loss logged.
    """
    run = load_run(run_dir)
    name = Path(run_dir).name
    out_dir = Path(out_dir)
    if not run.loss_series or not any(len(y) for _, y in run.loss_series.values()):
        raise UsageError(f"{run_dir}/metrics.jsonl has no training loss yet; nothing to plot")
    paths = []
    fig, ax = _new_figure(f"Training loss: {name}", "optimizer step", "training loss")
    all_y, hidden = [], 0
    for i, (key, (steps, values)) in enumerate(run.loss_series.items()):
        x, y = _finite(steps, values)
        hidden += len(values) - len(y)
        label = key if len(run.loss_series) > 1 else f"{run.precision or name}"
        ax.plot(x, y, color=f"C{i}", label=f"{label} ({len(y)} logged steps)", **_marker(len(y)))
        all_y.append(y)
    values = np.concatenate(all_y)
    if len(values) and np.all(values > 0):
        ax.set_yscale("log")
    if hidden:
        ax.set_title(f"Training loss: {name} ({hidden} non-finite values not shown)")
    _integer_x(ax)
    ax.legend()
    paths.append(_save(fig, out_dir, "loss.png"))
    axis = _eval_axis([run])
    if axis is not None:
        attr, ylabel, scale = axis
        epochs, values = (run.eval_epochs, run.accuracy) if attr == "accuracy" else (run.metric_epochs, run.metric)
        title = "Test accuracy" if attr == "accuracy" else "Evaluation"
        fig, ax = _new_figure(f"{title}: {name}", "epoch", ylabel)
        ax.plot(epochs, scale * values, marker="o", markersize=3, color="C1", label=run.precision or name)
        _integer_x(ax)
        ax.legend()
        paths.append(_save(fig, out_dir, "accuracy.png" if attr == "accuracy" else "eval.png"))
    health = plot_health(run_dir, out_dir)
    if health is not None:
        paths.append(health)
    return paths


# ------------------------------------------------------------------------------------------------ training health

_HEALTH_PANELS = (
    ("grad_norm", "gradient norm (before clipping)", True),
    ("update_ratio", "update / weight norm per step", True),
    ("dead_fraction", "dead ReLU units (fraction)", False),
)
LEGEND_UP_TO = 12  # series per panel named in a legend; more are told apart by colour (early blocks dark)


def plot_health(run_dir: str | Path, out_dir: str | Path) -> Path | None:
    """`health.png`: per block gradient norm, update-to-weight ratio and dead ReLU fraction vs step, one panel each
    (the rows `--health-every` logs; trainlab.engine.health). None when the run logged no health.

    Blocks are coloured in model order (dark: first blocks, light: last); the usual update ratio (1e-3) and the dead
    fraction that draws a warning (0.5) are dashed lines.
    """
    rows = latest_rows(RunDir(run_dir).read_metrics(), "health", "step")
    if not rows:
        return None
    import matplotlib

    from trainlab.engine.health_limits import DEAD_FRACTION_WARN, USUAL_UPDATE_RATIO

    fig = Figure(figsize=(9, 10), layout="constrained")
    axes = fig.subplots(len(_HEALTH_PANELS), 1, sharex=True)
    for ax, (kind, ylabel, log_y) in zip(axes, _HEALTH_PANELS):
        keys = list(dict.fromkeys(k for r in rows for k in r if k.startswith(kind + "/")))
        colors = matplotlib.colormaps["viridis"](np.linspace(0.0, 0.9, max(len(keys), 1)))
        for color, key in zip(colors, keys):
            x = np.asarray([r["step"] for r in rows if is_number(r.get(key))], dtype=np.int64)
            y = np.asarray([float(r[key]) for r in rows if is_number(r.get(key))])
            keep = np.isfinite(y) & ((y > 0) if log_y else True)
            label = key.split("/", 1)[1] if len(keys) <= LEGEND_UP_TO else None
            ax.plot(x[keep], y[keep], color=color, linewidth=1.0, label=label, **_marker(int(keep.sum())))
        if log_y and keys:
            ax.set_yscale("log")
        if kind == "update_ratio":
            ax.axhline(USUAL_UPDATE_RATIO, color="0.4", linestyle="--", linewidth=0.8, label="usual (1e-3)")
        if kind == "dead_fraction":
            ax.set_ylim(-0.02, 1.02)
            ax.axhline(DEAD_FRACTION_WARN, color="C3", linestyle="--", linewidth=0.8, label="warning")
        title = f"{ylabel}: {len(keys)} {'ReLU' if kind == 'dead_fraction' else 'block'}(s)"
        if not keys:
            title += " (none logged: no ReLU-family module)" if kind == "dead_fraction" else " (none logged)"
        elif len(keys) > LEGEND_UP_TO:
            title += ", dark = first, light = last"
        ax.set_title(title, fontsize=9)
        ax.set_ylabel(ylabel.split(" (")[0], fontsize=8)
        ax.grid(True, alpha=0.3)
        _legend(ax)
    axes[-1].set_xlabel("optimizer step")
    _integer_x(axes[-1])
    fig.suptitle(f"Training health: {Path(run_dir).name}")
    return _save(fig, Path(out_dir), "health.png")


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
    curves = {label: _group_curve(runs, "loss_steps", "loss", smooth=window) for label, runs in groups.items()}
    same = _same_as({label: (c[0], c[1]) for label, c in curves.items() if c is not None})
    for i, (label, runs) in enumerate(groups.items()):
        curve = curves[label]
        if curve is None:
            ax.plot([], [], color=colors[label], label=f"{label} (no finite loss)")
            continue
        x, mean, lo, hi = curve
        note = f" (same values as {same[label]})" if label in same else ""
        style = {"linestyle": _LINESTYLES[i % len(_LINESTYLES)], **_marker(len(x))}
        ax.plot(x, mean, color=colors[label], linewidth=1.2, label=label + _seed_note(runs) + note, **style)
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
    _integer_x(ax)
    _legend(ax)
    return _save(fig, out_dir, "loss_vs_step.png")


def _plot_accuracy_comparison(groups: dict[str, list[RunData]], colors: dict[str, str], out_dir: Path) -> Path:
    axis = _eval_axis([r for runs in groups.values() for r in runs]) or ("accuracy", "test accuracy (%)", 100.0)
    attr, ylabel, scale = axis
    x_attr, y_attr = ("eval_epochs", "accuracy") if attr == "accuracy" else ("metric_epochs", "metric")
    title = "Test accuracy by precision mode" if attr == "accuracy" else f"{ylabel} by run"
    fig, ax = _new_figure(title, "epoch", ylabel)
    lines = []
    curves = {label: _group_curve(runs, x_attr, y_attr, scale=scale) for label, runs in groups.items()}
    same = _same_as({label: (c[0], c[1]) for label, c in curves.items() if c is not None})
    for i, (label, runs) in enumerate(groups.items()):
        curve = curves[label]
        if curve is None:
            ax.plot([], [], color=colors[label], label=f"{label} (no eval)")
            continue
        x, mean, lo, hi = curve
        note = f" (same values as {same[label]})" if label in same else ""
        ax.plot(
            x,
            mean,
            color=colors[label],
            marker="os^Dv"[i % 5],
            markersize=3.5 if label not in same else 6.0,
            fillstyle="full" if label not in same else "none",
            linestyle=_LINESTYLES[i % len(_LINESTYLES)],
            linewidth=1.2,
            label=label + _seed_note(runs) + note,
        )
        if len(runs) > 1:
            ax.fill_between(x, lo, hi, color=colors[label], alpha=0.2, linewidth=0)
        lines.append((x, mean, colors[label]))
    if lines:
        last_epoch = max(int(x.max()) for x, _, _ in lines)
        tail = max(3, math.ceil(0.1 * last_epoch))
        if last_epoch >= 2 * tail:
            _tail_inset(ax, lines, last_epoch - tail, log_y=False, upper=attr != "accuracy")  # accuracy rises
    _integer_x(ax)
    _legend(ax)
    return _save(fig, out_dir, "accuracy_vs_epoch.png" if attr == "accuracy" else "eval_vs_epoch.png")


def _timing_note(groups: dict[str, list[RunData]]) -> str:
    """What the per-epoch times cover: whether the runs' first (warm-up) epoch is in them."""
    return timing_note([r.summary.get("first_epoch_timed") for runs in groups.values() for r in runs])


def _values(runs: list[RunData], key: str) -> list[float]:
    return [float(r.summary[key]) for r in runs if is_number(r.summary.get(key))]


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
            1 / MIB,
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
        title, ylabel, scale, fmt = f"Peak memory ({kind_text})", "peak memory (MiB)", 1 / MIB, "{:.0f}"
    else:
        title, ylabel, scale, fmt = (
            "Training time per epoch",
            f"train time per epoch (s, {_timing_note(groups)})",
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
        mean, std = mean_std(values)
        x = i - width / 2 if has_reserved else i
        ax.bar(x, mean, width, yerr=std, capsize=4, color=colors[label], label=label + _seed_note(groups[label]))
        timed = _values(groups[label], "epochs_timed") if key == "seconds_per_epoch" else []
        n_note = ""
        if timed:
            n_note = f"\nn={int(min(timed))}" + (f"-{int(max(timed))}" if max(timed) != min(timed) else "")
            n_note += " epoch" + ("" if max(timed) == 1 else "s")
            if any(r.summary.get("first_epoch_timed") is True for r in groups[label]):
                n_note += " (the first)"  # a one-epoch run: its only epoch, warm-up included
        ax.annotate(
            fmt.format(mean) + n_note,
            (x, mean + (std or 0.0)),
            ha="center",
            va="bottom",
            fontsize=8,
            xytext=(0, 2),
            textcoords="offset points",
        )
        if has_reserved:
            reserved = [v / MIB for v in _values(groups[label], "cuda_max_reserved_bytes")]
            if reserved:
                r_mean, r_std = mean_std(reserved)
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
    everything = [r for runs in groups.values() for r in runs]
    key, scale, ylabel = "final_test_accuracy", 100.0, "final test accuracy (%)"
    if not any(is_number(r.summary.get(key)) for r in everything):  # VAR, tokenizer: their tracked metric
        names = sorted({r.eval_metric for r in everything if r.eval_metric})
        key, scale, ylabel = "final_eval", 1.0, "final " + (" / ".join(names) or "evaluation metric")
    fig, ax = _new_figure(f"{ylabel[0].upper()}{ylabel[1:]} vs training time", "train time per epoch (s, "
                          f"{_timing_note(groups)})", ylabel)  # fmt: skip
    all_accuracies: list[float] = []
    for label, runs in groups.items():
        points = [
            (float(r.summary["seconds_per_epoch"]), scale * float(r.summary[key]))
            for r in runs
            if is_number(r.summary.get("seconds_per_epoch")) and is_number(r.summary.get(key))
        ]
        if not points:
            ax.scatter([], [], color=colors[label], label=f"{label} (no summary)")
            continue
        xs, ys = zip(*points)
        all_accuracies += ys
        ax.scatter(
            xs, ys, color=colors[label], s=36, label=label + (f" ({len(points)} seeds)" if len(points) > 1 else "")
        )
    if all_accuracies and key == "final_test_accuracy":  # accuracy cannot exceed 100%: do not pad past it
        lo, hi = min(all_accuracies), max(all_accuracies)
        pad = max(0.5, 0.08 * (hi - lo))
        ax.set_ylim(max(0.0, lo - pad), min(100.0, hi) + min(pad, 100.5 - min(100.0, hi)))
    _legend(ax)
    return _save(fig, out_dir, "accuracy_vs_time.png")
