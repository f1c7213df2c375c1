"""`trainlab runs [DIR] [--json]`: every run under a folder, its state, its last metrics and how to resume it.

    trainlab runs                 # runs/ (the default --run-dir parent)
    trainlab runs /scratch/runs --json

A run directory is any folder under DIR holding `metrics.jsonl` or `config.yaml` (nested ones too: `runs/demo/var`).
Its status is one of, checked in this order:

  running      `RUN_DIR/.lock` is held (flock) by a live process: a `trainlab train` is using the directory now.
  finished     `metrics.jsonl` has a `summary` row and the run reached its last step (all epochs, or --max-steps).
  interrupted  a checkpoint exists and no training step was logged after it (SIGTERM / Ctrl-C / preemption notice,
               or a stop right after a save): resuming loses nothing.
  failed       no checkpoint at all, or steps were logged after the last checkpoint (crash, SIGKILL, out of memory,
               diverged): resuming redoes those steps from the checkpoint (or, without one, starts over).

The resume command is the run's own command line (`# command:` in its config.yaml) without `--overwrite`: relaunching
a run directory that holds a checkpoint resumes it. EVAL is the metric that describes the run, chosen as `trainlab
report` chooses it: the one its recipe tracks for best.pt (named by the summary of a finished run), else the test
accuracy, else the first evaluation metric.

Listing imports no torch and no recipe: a checkpoint's step and epoch are read from its pickle alone
(`trainlab.engine.checkpoint_fields`), without its tensors.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import json
import math
import os
import shlex
import time
from pathlib import Path
from typing import Any

from trainlab.config import option, parse
from trainlab.engine.checkpoint_fields import UnreadableCheckpoint, read_fields
from trainlab.errors import UsageError
from trainlab.report.runs import describing_metric

_NOT_RUNS = {"tb", "ckpt", "wandb", "plots", "report", "__pycache__"}  # folders inside a run directory


@dataclasses.dataclass(kw_only=True)
class RunsConfig:
    """List every run under a folder: recipe, status, step/total, last metrics and the command that resumes it."""

    directory: Path = option(Path("runs"), "folder to search for run directories", positional=True, metavar="DIR")
    json: bool = option(False, "print a JSON list (one object per run) instead of the table")

    def validate(self) -> None:
        if not self.directory.is_dir():
            raise UsageError(f"{self.directory} is not a directory; pass the folder that holds your run directories")


@dataclasses.dataclass
class RunState:
    """What `trainlab runs` shows for one run directory."""

    run_dir: str
    recipe: str | None
    status: str  # running | finished | interrupted | failed
    step: int | None
    total_steps: int | None
    epoch: int | None
    epochs: int | None
    loss: float | None
    eval: dict[str, float]
    eval_metric: str | None  # the metric that describes the run (see the module docstring)
    checkpoint_step: int | None
    updated: float | None  # mtime of the newest of metrics.jsonl / ckpt/last.pt (seconds since the epoch)
    owner: str | None  # "pid 123 on host" of a running run
    command: str | None  # the command that resumes it (None when it is finished or no command was recorded)


def find_run_dirs(root: Path) -> list[Path]:
    """Folders under `root` (itself included) that hold `metrics.jsonl` or `config.yaml`, sorted by path."""
    found = []
    for here, subdirs, files in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in _NOT_RUNS and not d.startswith("."))
        if "metrics.jsonl" in files or "config.yaml" in files:
            found.append(Path(here))
    return found


def _lock_owner(run_dir: Path) -> str | None:
    """'pid P on HOST' when `run_dir/.lock` is flock-held by a live process, else None."""
    path = run_dir / ".lock"
    try:
        handle = open(path)  # noqa: SIM115 - closed below; never created here
    except OSError:
        return None
    with handle:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)  # conflicts with the trainer's LOCK_EX
        except OSError as err:
            if err.errno not in (errno.EAGAIN, errno.EACCES):
                return None
            try:
                info = json.loads(handle.read() or "{}")
            except json.JSONDecodeError:
                info = {}
            return f"pid {info.get('pid', '?')} on {info.get('host', '?')}"
        fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
    return None


def _read_rows(path: Path) -> list[dict[str, Any]]:
    rows = []
    if path.is_file():
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by a kill
            if isinstance(row, dict):
                rows.append(row)
    return rows


def _header(run_dir: Path) -> tuple[dict[str, str], dict[str, Any]]:
    """The provenance comments (`# recipe: ...`, `# command: ...`) and the values of `config.yaml`."""
    import yaml

    path = run_dir / "config.yaml"
    if not path.is_file():
        return {}, {}
    text = path.read_text(encoding="utf-8", errors="replace")
    header = {}
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        key, sep, value = line[1:].strip().partition(": ")
        if sep:
            header[key] = value
    try:
        values = yaml.safe_load(text)
    except yaml.YAMLError:
        values = None
    return header, values if isinstance(values, dict) else {}


def _checkpoint(run_dir: Path) -> tuple[dict[str, Any], float | None]:
    """Position fields of the newest readable checkpoint (`ckpt/last.pt`, else the newest `ckpt/step_*.pt`) and its
    mtime; ({}, None) when there is none."""
    ckpt = run_dir / "ckpt"
    candidates = [ckpt / "last.pt", *sorted(ckpt.glob("step_*.pt"), reverse=True)] if ckpt.is_dir() else []
    keys = ("recipe", "step", "epoch", "step_in_epoch", "best_score")
    for path in candidates:
        if not path.is_file():
            continue
        try:
            fields = read_fields(path, keys)
        except (UnreadableCheckpoint, OSError):  # a file cut by a kill: try the previous one
            continue
        return {k: fields.get(k) for k in keys}, path.stat().st_mtime
    return {}, None


def _total_steps(rows: list[dict[str, Any]], ckpt: dict[str, Any], config: dict[str, Any]) -> int | None:
    """Optimizer steps of the whole run: a logged `total_steps`, else steps per epoch (from a checkpoint past its
    first epoch) x epochs, capped by --max-steps."""
    logged = [r["total_steps"] for r in rows if isinstance(r.get("total_steps"), int)]
    if logged:
        return int(logged[-1])
    epochs, max_steps = config.get("epochs"), config.get("max_steps")
    step, epoch, in_epoch = ckpt.get("step"), ckpt.get("epoch"), ckpt.get("step_in_epoch")
    total = None
    if isinstance(epochs, int) and isinstance(step, int) and isinstance(epoch, int) and isinstance(in_epoch, int):
        total = (step - in_epoch) // epoch * epochs if epoch > 0 else None
    if isinstance(max_steps, int) and max_steps > 0:
        total = max_steps if total is None else min(total, max_steps)
    return total


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return None
    try:
        return float(value)  # "nan" / "inf" strings: non-finite values are stored as text
    except ValueError:
        return None


def _loss(row: dict[str, Any]) -> float | None:
    if "loss" in row:
        return _number(row["loss"])
    return next((_number(v) for k, v in row.items() if k.endswith("/loss")), None)


def resume_command(command: str) -> str:
    """The recorded command line without `--overwrite` (which would start over): relaunching it resumes the run."""
    words = shlex.split(command)
    kept: list[str] = []
    skip_value = False
    for i, word in enumerate(words):
        if skip_value:
            skip_value = False
            continue
        if word.startswith("--overwrite="):
            continue
        if word == "--overwrite":
            following = words[i + 1].lower() if i + 1 < len(words) else ""
            skip_value = following in ("true", "false", "1", "0", "yes", "no", "on", "off")
            continue
        kept.append(word)
    return shlex.join(kept)


def run_state(run_dir: Path) -> RunState:
    """The state of one run directory (see the module docstring for the status rules)."""
    header, config = _header(run_dir)
    rows = _read_rows(run_dir / "metrics.jsonl")
    ckpt, ckpt_mtime = _checkpoint(run_dir)
    train = [r for r in rows if r.get("kind") == "train" and isinstance(r.get("step"), int)]
    evals = [r for r in rows if r.get("kind") == "eval"]
    summaries = [r for r in rows if r.get("kind") == "summary"]
    logged_step = max((int(r["step"]) for r in train + summaries), default=None)
    ckpt_step = ckpt.get("step") if isinstance(ckpt.get("step"), int) else None
    step = max((s for s in (logged_step, ckpt_step) if s is not None), default=None)
    total = _total_steps(rows, ckpt, config)
    epochs = config.get("epochs") if isinstance(config.get("epochs"), int) else None
    last_summary = summaries[-1] if summaries else None
    reached_end = last_summary is not None and (
        (total is not None and isinstance(last_summary.get("step"), int) and last_summary["step"] >= total)
        or (epochs is not None and isinstance(last_summary.get("epoch"), int) and last_summary["epoch"] >= epochs)
    )
    owner = _lock_owner(run_dir)
    if owner is not None:
        status = "running"
    elif reached_end:
        status = "finished"
    elif ckpt_step is not None and (logged_step is None or logged_step <= ckpt_step):
        status = "interrupted"
    else:
        status = "failed"
    mtimes = [p.stat().st_mtime for p in (run_dir / "metrics.jsonl",) if p.is_file()]
    command = header.get("command")
    last_eval = {k: v for k, v in (evals[-1] if evals else {}).items() if k not in ("kind", "step", "epoch")}
    eval_values = {k: f for k, v in last_eval.items() if (f := _number(v)) is not None}
    return RunState(
        run_dir=str(run_dir),
        recipe=header.get("recipe") or ckpt.get("recipe"),
        status=status,
        step=step,
        total_steps=total,
        epoch=ckpt.get("epoch") if isinstance(ckpt.get("epoch"), int) else None,
        epochs=epochs,
        loss=_loss(train[-1]) if train else None,
        eval=eval_values,
        eval_metric=describing_metric([eval_values], last_summary or {}),
        checkpoint_step=ckpt_step,
        updated=max([*mtimes, *([ckpt_mtime] if ckpt_mtime else [])], default=None),
        owner=owner,
        command=resume_command(command) if command and status in ("interrupted", "failed") else None,
    )


def _eval_text(state: RunState) -> str:
    """The metric that describes the run and its last value, e.g. `test_accuracy 0.9123`."""
    if state.eval_metric is None:
        return "-"
    return f"{state.eval_metric} {state.eval[state.eval_metric]:.4g}"


def _age(updated: float | None, now: float) -> str:
    if updated is None:
        return "-"
    seconds = max(0.0, now - updated)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit} ago"
    return f"{seconds:.0f}s ago"


def format_table(states: list[RunState], root: Path, now: float | None = None) -> str:
    """The human-readable table, then one resume command per interrupted or failed run."""
    now = time.time() if now is None else now
    header = ["RUN", "RECIPE", "STATUS", "STEP", "LOSS", "EVAL", "UPDATED"]
    rows = []
    for s in states:
        name = os.path.relpath(s.run_dir, root)
        step = "-" if s.step is None else f"{s.step}/{s.total_steps if s.total_steps is not None else '?'}"
        loss = "-" if s.loss is None else ("nan" if math.isnan(s.loss) else f"{s.loss:.4g}")
        status = s.status + (f" ({s.owner})" if s.owner else "")
        rows.append([name, s.recipe or "?", status, step, loss, _eval_text(s), _age(s.updated, now)])
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in [header, *rows]]
    to_resume = [s for s in states if s.status in ("interrupted", "failed")]
    if to_resume:
        lines += ["", "to resume (relaunching the same command continues from the checkpoint):"]
        for s in to_resume:
            lines.append(f"  {os.path.relpath(s.run_dir, root)}: {s.command or '(no command recorded in config.yaml)'}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """Run `trainlab runs`; returns the exit code."""
    config = parse(RunsConfig, argv, prog="trainlab runs", epilog=__doc__ or "")
    states = [run_state(d) for d in find_run_dirs(config.directory)]
    if config.json:
        print(json.dumps([dataclasses.asdict(s) for s in states], indent=2))
    elif not states:
        print(f"no run directories under {config.directory} (folders with metrics.jsonl or config.yaml)")
    else:
        print(format_table(states, config.directory))
    return 0
