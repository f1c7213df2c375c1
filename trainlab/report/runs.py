"""Reading run directories (`metrics.jsonl` + `config.yaml`) into series and one summary row per run.

`metrics.jsonl` holds one JSON object per line with "kind" ("train" | "eval" | "summary" | other kinds, ignored
here), "step" (optimizer step) and "epoch", plus numeric metrics. Conventions this module relies on:
- accuracies are fractions in [0, 1] (plots and tables show percent); a run whose accuracies exceed 1 is taken to
  be in percent already, with a warning;
- non-finite floats are stored as the strings "nan" / "inf" / "-inf" (JSON has no such numbers) and read back as
  floats;
- a resumed run appends to the same file, so steps logged after the last checkpoint appear twice: when the same
  (kind, step) or eval epoch occurs again, the later row wins.
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
import yaml

from trainlab.errors import UsageError

log = logging.getLogger(__name__)

ACCURACY_KEYS = ("test_accuracy", "accuracy")  # eval-row keys, first found wins
_NONFINITE = {
    "nan": math.nan,
    "NaN": math.nan,
    "inf": math.inf,
    "Infinity": math.inf,
    "-inf": -math.inf,
    "-Infinity": -math.inf,
}


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


def is_number(value: Any) -> bool:
    """True for an int or float metric value (bools excluded; nan and inf included)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _series(rows: list[dict[str, Any]], key: str) -> tuple[np.ndarray, np.ndarray]:
    xs = [r["_x"] for r in rows if is_number(r.get(key))]
    ys = [float(r[key]) for r in rows if is_number(r.get(key))]
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
    acc_key = next((k for k in ACCURACY_KEYS if any(is_number(r.get(k)) for r in evals)), ACCURACY_KEYS[0])
    eval_epochs, accuracy = _series(evals, acc_key)
    summary_acc = {k: summary[k] for k in ("final_" + acc_key, "best_" + acc_key) if is_number(summary.get(k))}
    if np.any(accuracy > 1.0) or any(v > 1.0 for v in summary_acc.values()):
        log.warning("%s: accuracies above 1, reading them as percent", run_dir)
        accuracy = accuracy / 100.0
        summary_acc = {k: v / 100.0 for k, v in summary_acc.items()}
    summary["final_test_accuracy"] = summary_acc.get("final_" + acc_key, float(accuracy[-1]) if len(accuracy) else None)
    summary["best_test_accuracy"] = summary_acc.get("best_" + acc_key, float(accuracy.max()) if len(accuracy) else None)
    final_train_loss = None
    last_epoch = max((int(r["epoch"]) for r in train if is_number(r.get("epoch"))), default=None)
    if last_epoch is not None:
        last = [float(r["loss"]) for r in train if r.get("epoch") == last_epoch and is_number(r.get("loss"))]
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
