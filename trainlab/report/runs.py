"""Run directories (`metrics.jsonl` + `config.yaml`, read by `engine.run_dir.RunDir`) as series and one summary row
per run.

`metrics.jsonl` holds one JSON object per line with "kind" ("train" | "eval" | "summary" | other kinds, ignored
here), "step" (optimizer step) and "epoch", plus numeric metrics. Conventions this module relies on:
- accuracies are fractions in [0, 1] (plots and tables show percent); a run whose accuracies exceed 1 is taken to
  be in percent already, with a warning;
- non-finite floats are stored as the strings "nan" / "inf" / "-inf" (JSON has no such numbers) and read back as
  floats;
- a resumed run appends to the same file, so steps logged after the last checkpoint appear twice: when the same
  (kind, step) or eval epoch occurs again, the later row wins;
- the training loss is "loss", or "<phase>/loss" for recipes with several optimizers (the tokenizer's
  "generator/loss" and "discriminator/loss"): the first is the run's main loss;
- the evaluation metric that describes a run is the one its recipe tracks for `best.pt` (the summary row's
  "best_<metric>"), else the test accuracy, else the first numeric evaluation metric;
- the summary's `seconds_per_epoch` averages the full epochs the last process trained, without its first one when
  it trained more than one (warm-up); `first_epoch_timed` says which case a run is in (see `first_epoch_timed`).

A file that is not UTF-8 text, not readable or not what it should be is a `UsageError` naming it, so a command can
skip that run with a warning and report the others.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from trainlab.engine.run_dir import RunDir
from trainlab.errors import printable

log = logging.getLogger(__name__)

ACCURACY_KEYS = ("test_accuracy", "accuracy")  # eval-row keys, first found wins


def latest_rows(rows: Iterable[dict[str, Any]], kind: str, x_key: str) -> list[dict[str, Any]]:
    """Rows of one kind, one per `x_key` value (the last written wins), sorted by it."""
    by_x: dict[int, dict[str, Any]] = {}
    for row in rows:
        if row.get("kind") == kind and is_position(row.get(x_key)):
            by_x[int(row[x_key])] = row
    return [by_x[x] for x in sorted(by_x)]


def is_position(value: Any) -> bool:
    """A step or epoch a damaged row cannot fake: a whole number in [0, 2**62] (not NaN, inf, -1e300 or a bool)."""
    return is_number(value) and math.isfinite(value) and 0 <= value <= 2**62 and float(value).is_integer()


def is_number(value: Any) -> bool:
    """True for an int or float metric value (bools excluded; nan and inf included; an int too large for a float,
    which only a damaged file holds, excluded)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return not isinstance(value, int) or abs(value) <= 2**1023


def _series(rows: list[dict[str, Any]], key: str) -> tuple[np.ndarray, np.ndarray]:
    xs = [r["_x"] for r in rows if is_number(r.get(key))]
    ys = [float(r[key]) for r in rows if is_number(r.get(key))]
    return np.asarray(xs, dtype=np.int64), np.asarray(ys, dtype=np.float64)


def loss_keys(rows: Iterable[dict[str, Any]]) -> list[str]:
    """The training-loss keys of a run, main one first: ["loss"], or the "<phase>/loss" keys in first-seen order."""
    seen: list[str] = []
    for row in rows:
        for key in row:
            if (key == "loss" or key.endswith("/loss")) and key not in seen:
                seen.append(key)
    return ["loss"] if "loss" in seen else seen


def describing_metric(evals: list[dict[str, Any]], summary: dict[str, Any]) -> str | None:
    """The evaluation metric that describes a run (see the module docstring), or None when it has none."""
    numeric = [k for r in evals for k, v in r.items() if is_number(v) and k not in ("step", "epoch", "_x")]
    tracked = [k[len("best_") :] for k in summary if k.startswith("best_") and k[len("best_") :] in numeric]
    if tracked:
        return tracked[0]
    accuracy = [k for k in ACCURACY_KEYS if k in numeric]
    return (accuracy or numeric)[0] if accuracy or numeric else None


def first_epoch_timed(rows: Sequence[dict[str, Any]], config: dict[str, Any]) -> bool | None:
    """Whether the last summary's `seconds_per_epoch` includes the first epoch its process trained (None: unknown).

    The engine times the full epochs of a process and leaves out the first when there are several (warm-up: data
    loader start, allocator growth); with one full epoch that epoch is all there is. `epochs_timed` >= 2 therefore
    means excluded; with 1, the process's full epochs are counted from its "start" event (step, epoch, total_steps)
    to the summary: a process that resumed mid-epoch trained that epoch partly, which is never timed.
    """
    last = max((i for i, row in enumerate(rows) if row.get("kind") == "summary"), default=None)
    if last is None:
        return None
    summary = rows[last]
    if isinstance(summary.get("first_epoch_timed"), bool):  # recorded by the engine itself
        return bool(summary["first_epoch_timed"])
    timed = summary.get("epochs_timed")
    if not isinstance(timed, (int, float)) or timed < 1:
        return None
    if timed >= 2:
        return False
    start = next(
        (row for row in reversed(rows[:last]) if row.get("kind") == "event" and row.get("event") == "start"), None
    )
    epochs = config.get("epochs")
    if start is None or not isinstance(epochs, int) or epochs < 1:
        return None
    numbers = [start.get("step"), start.get("epoch"), start.get("total_steps"), summary.get("epoch")]
    if not all(isinstance(n, int) for n in numbers):
        return None
    start_step, start_epoch, total_steps, end_epoch = (int(n) for n in numbers if isinstance(n, int))
    steps_per_epoch = total_steps // epochs
    if steps_per_epoch < 1:
        return None
    partial_first = start_step > start_epoch * steps_per_epoch
    full_epochs = end_epoch - start_epoch - (1 if partial_first and end_epoch > start_epoch else 0)
    return full_epochs <= 1


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
    final_train_loss: float | None = None  # the main loss at the last logged step
    final_train_loss_step: int | None = None
    recipe: str | None = None
    loss_name: str = "loss"
    loss_series: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)  # every loss key: (step, y)
    eval_metric: str | None = None  # see the module docstring
    metric_epochs: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    metric: np.ndarray = field(default_factory=lambda: np.empty(0))


def load_run(run_dir: str | Path) -> RunData:
    """Reads one run directory into the series and summary numbers used by the plots and tables."""
    run_dir = Path(run_dir)
    files = RunDir(run_dir)
    rows = files.read_metrics()
    config = files.read_config()
    train = [{**r, "_x": r["step"]} for r in latest_rows(rows, "train", "step")]
    evals = [{**r, "_x": r["epoch"]} for r in latest_rows(rows, "eval", "epoch")]
    summaries = [r for r in rows if r["kind"] == "summary"]
    summary = dict(summaries[-1]) if summaries else {}
    summary["first_epoch_timed"] = first_epoch_timed(rows, config)
    keys = loss_keys(train)
    loss_series = {key: _series(train, key) for key in keys}
    loss_name = keys[0] if keys else "loss"
    loss_steps, loss = loss_series.get(loss_name, _series(train, "loss"))
    acc_key = next((k for k in ACCURACY_KEYS if any(is_number(r.get(k)) for r in evals)), ACCURACY_KEYS[0])
    eval_epochs, accuracy = _series(evals, acc_key)
    summary_acc = {k: summary[k] for k in ("final_" + acc_key, "best_" + acc_key) if is_number(summary.get(k))}
    if np.any(accuracy > 1.0) or any(v > 1.0 for v in summary_acc.values()):
        log.warning("%s: accuracies above 1, reading them as percent", run_dir)
        accuracy = accuracy / 100.0
        summary_acc = {k: v / 100.0 for k, v in summary_acc.items()}
    summary["final_test_accuracy"] = summary_acc.get("final_" + acc_key, float(accuracy[-1]) if len(accuracy) else None)
    summary["best_test_accuracy"] = summary_acc.get("best_" + acc_key, float(accuracy.max()) if len(accuracy) else None)
    eval_metric = describing_metric(evals, summary)
    metric_epochs, metric = _series(evals, eval_metric) if eval_metric else (np.empty(0, np.int64), np.empty(0))
    if eval_metric is not None:
        final = summary.get("final_" + eval_metric)
        best = summary.get("best_" + eval_metric)
        summary["eval_metric"] = eval_metric
        summary["final_eval"] = final if is_number(final) else (float(metric[-1]) if len(metric) else None)
        summary["best_eval"] = best if is_number(best) else None
    final_train_loss, final_train_loss_step = None, None
    if len(loss):  # the last logged step's loss (nan if the run diverged: keep it visible)
        final_train_loss, final_train_loss_step = float(loss[-1]), int(loss_steps[-1])
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
        final_train_loss_step=final_train_loss_step,
        recipe=files.recipe(),
        loss_name=loss_name,
        loss_series=loss_series,
        eval_metric=eval_metric,
        metric_epochs=metric_epochs,
        metric=metric,
    )


def summarize_run(run_dir: str | Path, label: str | None = None) -> dict[str, Any]:
    """One row for `write_results_table`.

    Args:
        run_dir: the run directory.
        label: the group this run belongs to (runs sharing a label are seeds of one configuration); defaults to
            the run's precision, else the directory name.

    Returns:
        A dict with keys: label, run_dir, recipe, model, precision, seed, final_test_accuracy, best_test_accuracy
        (fractions), eval_metric, final_eval, best_eval (the run's tracked evaluation metric), final_train_loss (the
        main loss at the last logged step), final_train_loss_step, peak_memory_bytes, memory_kind,
        cuda_max_reserved_bytes, seconds_per_epoch, epochs_timed, first_epoch_timed (whether the timing includes
        the first epoch: a one-epoch run; see `first_epoch_timed`), images_per_second, achieved_tflops (per device)
        and mfu (None where the run did not record them; mfu only where the device's peak is known).
    """
    return _summary_row(load_run(run_dir), label)


def _summary_row(run: RunData, label: str | None) -> dict[str, Any]:
    s = run.summary
    return {
        "label": printable(label or run.precision or run.run_dir.name),
        "run_dir": str(run.run_dir),
        "recipe": run.recipe,
        "model": run.model,
        "precision": run.precision,
        "seed": run.seed,
        "final_test_accuracy": s.get("final_test_accuracy"),
        "best_test_accuracy": s.get("best_test_accuracy"),
        "eval_metric": run.eval_metric,
        "final_eval": s.get("final_eval"),
        "best_eval": s.get("best_eval"),
        "final_train_loss": run.final_train_loss,
        "final_train_loss_step": run.final_train_loss_step,
        "peak_memory_bytes": s.get("peak_memory_bytes"),
        "memory_kind": s.get("memory_kind"),
        "cuda_max_reserved_bytes": s.get("cuda_max_reserved_bytes"),
        "cpu_peak_rss_growth_bytes": s.get("cpu_peak_rss_growth_bytes"),
        "seconds_per_epoch": s.get("seconds_per_epoch"),
        "epochs_timed": s.get("epochs_timed"),
        "first_epoch_timed": s.get("first_epoch_timed"),
        "images_per_second": s.get("images_per_second"),
        "achieved_tflops": s.get("achieved_tflops"),
        "mfu": s.get("mfu"),
    }


def different_kinds(runs: Sequence[RunData]) -> str:
    """'' when the runs share their recipe and model, else a one-line description of what differs (for a warning:
    their losses and metrics are not comparable)."""
    parts = []
    for what, values in (("recipes", [r.recipe for r in runs]), ("models", [r.model for r in runs])):
        distinct = sorted({v for v in values if v is not None})
        if len(distinct) > 1:  # names from the runs' files, shortened: a damaged header's cannot flood the line
            parts.append(f"{what} {', '.join(printable(v if len(v) <= 40 else v[:37] + '...') for v in distinct)}")
    return "; ".join(parts)


def group_runs(run_dirs: Sequence[str | Path]) -> dict[str, list[Path]]:
    """Groups run directories that differ only in their seed, labelled by precision (plus model if ambiguous).

    Runs are grouped by their config with seed and bookkeeping fields (run_dir, resume, logging options) removed. A
    run with the same config and seed as one already grouped (a copy) is left out with a warning: it is no other seed.

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
        "pin_memory",
        "persistent_workers",
        "prefetch_factor",
        "log_every",
        "checkpoint_every",
        "memory_snapshot",
        "health_every",
        "dist_timeout",
    }
    keyed: dict[str, list[Path]] = {}
    info: dict[str, tuple[str, str | None]] = {}
    seeds: dict[tuple[str, str], Path] = {}
    for run_dir in map(Path, run_dirs):
        config = RunDir(run_dir).read_config()
        run = load_run(run_dir)
        identity = {k: v for k, v in config.items() if k not in ignored} if config else {"dir": str(run_dir)}
        key = json.dumps(identity, sort_keys=True, default=str)
        seed = json.dumps(config.get("seed") if config else None, default=str)
        if (key, seed) in seeds:  # a copy of a run, not another seed: a mean +- std over copies says nothing
            log.warning("%s repeats %s (same config, same seed): counted once", run_dir, seeds[(key, seed)])
            continue
        seeds[(key, seed)] = run_dir
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
