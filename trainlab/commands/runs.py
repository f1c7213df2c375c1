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
import math
import os
import shlex
import time
from pathlib import Path
from typing import Any

from trainlab.config import FALSE_WORDS, TRUE_WORDS, option, parse
from trainlab.engine.checkpoint_fields import UnreadableCheckpoint, read_fields
from trainlab.engine.run_dir import RunDir
from trainlab.errors import UsageError
from trainlab.json_out import dumps_json
from trainlab.report.runs import describing_metric, is_position


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
    stop_step: int | None  # the step the run ends at: all epochs, or --max-steps (`engine.run_length`)
    total_steps: int | None  # the schedule's horizon: epochs x steps per epoch
    epoch: int | None
    epochs: int | None
    loss: float | None
    eval: dict[str, float]
    eval_metric: str | None  # the metric that describes the run (see the module docstring)
    checkpoint_step: int | None
    updated: float | None  # mtime of the newest of metrics.jsonl / ckpt/last.pt (seconds since the epoch)
    owner: str | None  # "pid 123 on host" of a running run
    command: str | None  # the command that resumes it (None when it is finished or no command was recorded)


def _checkpoint(files: RunDir) -> tuple[dict[str, Any], float | None]:
    """Where the newest readable checkpoint stands (`ckpt/last.pt`, else the newest `ckpt/step_*.pt`: recipe, step,
    epoch, step_in_epoch, best_score) and its mtime; ({}, None) when there is none. Read from the pickle alone
    (`engine.checkpoint_fields`): no torch, no tensors."""
    ckpt = files.ckpt
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


def resume_command(command: str, run_dir: Path | None = None) -> str:
    """The recorded command line without `--overwrite` (which would start over): relaunching it resumes the run.

    With `run_dir` (where the run was found), a recorded `--run-dir` that names another folder from here (the run was
    moved, or recorded relative to another working directory) is replaced by it: the command resumes this run. Not
    in a `trainlab demo` command, whose `--run-dir` is the folder of all its stages.
    """
    words = shlex.split(command)
    if "demo" in words[1:2]:  # `trainlab demo --run-dir D` names the demo's folder, its stages are D/<stage>
        run_dir = None
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
            skip_value = following in (*TRUE_WORDS, *FALSE_WORDS)
            continue
        if run_dir is not None and ((word == "--run-dir" and i + 1 < len(words)) or word.startswith("--run-dir=")):
            recorded = word.split("=", 1)[1] if "=" in word else words[i + 1]
            skip_value = "=" not in word
            here = recorded if _same_folder(Path(recorded), run_dir) else str(run_dir)
            kept += ["--run-dir", here]
            continue
        kept.append(word)
    return shlex.join(kept)


def _same_folder(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except OSError:
        return False


def _whole(value: Any) -> bool:
    """A step or epoch count read from a file: an int in [0, 2**62] (a damaged file's bool, float or 5000-digit
    number is no count)."""
    return isinstance(value, int) and is_position(value)


def _resume_or_none(command: Any, run_dir: Path) -> str | None:
    """`resume_command`, or None where the recorded command is no shell command (an unclosed quote: a damaged header,
    listed without a resume line)."""
    try:
        return resume_command(str(command), run_dir)
    except ValueError:
        return None


def run_state(run_dir: Path) -> RunState:
    """The state of one run directory (see the module docstring for the status rules)."""
    files = RunDir(run_dir)
    try:
        header = files.header()
        config = files.read_config()
    except UsageError:  # an unreadable or damaged config.yaml: list the run with what the other files say
        header, config = {}, {}
    rows = files.read_metrics(skip_damaged=True)
    ckpt, ckpt_mtime = _checkpoint(files)
    train = [r for r in rows if r.get("kind") == "train" and _whole(r.get("step"))]
    evals = [r for r in rows if r.get("kind") == "eval"]
    summaries = [r for r in rows if r.get("kind") == "summary"]
    logged_step = max((int(r["step"]) for r in train + summaries if is_position(r.get("step"))), default=None)
    ckpt_step = ckpt["step"] if _whole(ckpt.get("step")) else None
    step = max((s for s in (logged_step, ckpt_step) if s is not None), default=None)
    length = files.length(rows, config, _steps_per_epoch(ckpt))
    epochs = config["epochs"] if _whole(config.get("epochs")) else None
    owner = files.lock_owner()
    if owner is not None:
        status = "running"
    elif files.is_finished(rows, config, _steps_per_epoch(ckpt)):
        status = "finished"
    elif ckpt_step is not None and (logged_step is None or logged_step <= ckpt_step):
        status = "interrupted"
    else:
        status = "failed"
    mtimes = [files.metrics.stat().st_mtime] if files.metrics.is_file() else []
    command = header.get("command")
    last_eval = {k: v for k, v in (evals[-1] if evals else {}).items() if k not in ("kind", "step", "epoch")}
    eval_values = {k: f for k, v in last_eval.items() if (f := _number(v)) is not None}
    return RunState(
        run_dir=str(run_dir),
        recipe=header.get("recipe") or ckpt.get("recipe"),
        status=status,
        step=step,
        stop_step=length.stop_step if length is not None else None,
        total_steps=length.total_steps if length is not None else None,
        epoch=ckpt["epoch"] if _whole(ckpt.get("epoch")) else None,
        epochs=epochs,
        loss=_loss(train[-1]) if train else None,
        eval=eval_values,
        eval_metric=describing_metric([eval_values], summaries[-1] if summaries else {}),
        checkpoint_step=ckpt_step,
        updated=max([*mtimes, *([ckpt_mtime] if ckpt_mtime else [])], default=None),
        owner=owner,
        command=_resume_or_none(command, run_dir) if command and status in ("interrupted", "failed") else None,
    )


def _steps_per_epoch(ckpt: dict[str, Any]) -> int | None:
    """Steps per epoch from a checkpoint past its first epoch (step - step_in_epoch = epoch x steps per epoch)."""
    step, epoch, in_epoch = ckpt.get("step"), ckpt.get("epoch"), ckpt.get("step_in_epoch")
    if isinstance(step, int) and isinstance(epoch, int) and isinstance(in_epoch, int) and epoch > 0:
        return (step - in_epoch) // epoch
    return None


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


def _cell(text: str, width: int = 40) -> str:
    """A table cell of text from a run's files, one line of at most `width` characters."""
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."


def format_table(states: list[RunState], root: Path, now: float | None = None) -> str:
    """The human-readable table, then one resume command per interrupted or failed run."""
    now = time.time() if now is None else now
    header = ["RUN", "RECIPE", "STATUS", "STEP", "LOSS", "EVAL", "UPDATED"]
    rows = []
    for s in states:
        name = os.path.relpath(s.run_dir, root)
        step = "-" if s.step is None else f"{s.step}/{s.stop_step if s.stop_step is not None else '?'}"
        loss = "-" if s.loss is None else ("nan" if math.isnan(s.loss) else f"{s.loss:.4g}")
        status = s.status + (f" ({s.owner})" if s.owner else "")
        recipe = _cell(str(s.recipe)) if s.recipe else "?"  # read from the run's files: a damaged one is cut short
        rows.append([name, recipe, status, step, loss, _cell(_eval_text(s)), _age(s.updated, now)])
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
    states = [run_state(d.path) for d in RunDir.find(config.directory)]
    if config.json:
        print(dumps_json([dataclasses.asdict(s) for s in states], indent=2))
    elif not states:
        print(f"no run directories under {config.directory} (folders with metrics.jsonl or config.yaml)")
    else:
        print(format_table(states, config.directory))
    return 0
