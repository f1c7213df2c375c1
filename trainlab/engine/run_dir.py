"""A run directory: where each of a run's files is, and the one reader of each. Imports no torch.

    RUN_DIR/config.yaml        the resolved config (re-runnable with --config) under a provenance header of YAML
                               comments (`# recipe: var`, `# command: ...`, versions)
    RUN_DIR/environment.yaml   the same provenance as YAML keys
    RUN_DIR/metrics.jsonl      one JSON object per line: "kind" (train | eval | summary | event), "step", "epoch",
                               metrics; non-finite floats as the strings "nan" / "inf" / "-inf"; a resumed run
                               appends (steps after the last checkpoint appear twice: the later row wins)
    RUN_DIR/ckpt/              last.pt, best.pt, step_*.pt (`engine.checkpoint.CheckpointStore`); --fsdp: + step_*.dcp/
    RUN_DIR/tb/                TensorBoard scalars
    RUN_DIR/wandb_run_id       the W&B run a resumed run continues
    RUN_DIR/.lock              held (flock) by the process training in it (`engine.run_lock`)

A run directory is a folder holding `metrics.jsonl` or `config.yaml`; `RunDir.find(root)` lists them. The Trainer
writes through these paths; `trainlab runs`, `trainlab report`, `trainlab bench` and `trainlab eval` read through
`read_metrics`, `read_config`, `header` and `is_finished`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import yaml

from trainlab.engine.run_length import RunLength, run_length
from trainlab.engine.run_lock import LOCK_NAME, lock_owner
from trainlab.errors import UsageError, first_line, missing_file

log = logging.getLogger(__name__)

METRICS = "metrics.jsonl"
CONFIG = "config.yaml"
ENVIRONMENT = "environment.yaml"
CKPT = "ckpt"
TB = "tb"
WANDB_RUN_ID = "wandb_run_id"
PLOTS = "plots"
INSIDE_A_RUN = frozenset({CKPT, TB, "wandb", PLOTS, "report", "__pycache__"})
"""Folders a run (or a report of it) writes inside its run directory: never searched for run directories."""

_NONFINITE = {
    "nan": float("nan"),
    "NaN": float("nan"),
    "inf": float("inf"),
    "Infinity": float("inf"),
    "-inf": float("-inf"),
    "-Infinity": float("-inf"),
}


class RunDir:
    """One run directory (see the module docstring): its paths and the readers of its files."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RunDir) and other.path == self.path

    def __hash__(self) -> int:
        return hash(self.path)

    # ------------------------------------------------------------------------------------------------ paths
    @property
    def metrics(self) -> Path:
        return self.path / METRICS

    @property
    def config(self) -> Path:
        return self.path / CONFIG

    @property
    def environment(self) -> Path:
        return self.path / ENVIRONMENT

    @property
    def ckpt(self) -> Path:
        return self.path / CKPT

    @property
    def tb(self) -> Path:
        return self.path / TB

    @property
    def wandb_run_id(self) -> Path:
        return self.path / WANDB_RUN_ID

    @property
    def lock(self) -> Path:
        return self.path / LOCK_NAME

    @property
    def plots(self) -> Path:
        return self.path / PLOTS

    # ------------------------------------------------------------------------------------------------ finding
    @staticmethod
    def find(root: str | os.PathLike[str]) -> list[RunDir]:
        """The run directories under `root` (itself included), sorted by path. The folders a run writes inside
        itself (`INSIDE_A_RUN`) and hidden ones are not searched."""
        found = []
        for here, subdirs, files in os.walk(root):
            subdirs[:] = sorted(d for d in subdirs if d not in INSIDE_A_RUN and not d.startswith("."))
            if METRICS in files or CONFIG in files:
                found.append(RunDir(here))
        return found

    # ----------------------------------------------------------------------------------------------- writing
    def prepare(self) -> None:
        """Create the directory, or a one-line UsageError when it cannot be written, or when one of the run's own
        files is something else than a file (a FIFO would block the first write forever, a folder fail it) or one of
        its folders is not a folder."""
        if (self.path.exists() or self.path.is_symlink()) and not self.path.is_dir():
            raise UsageError(f"run directory {self.path} {missing_file(self.path)}; pass a folder as --run-dir")
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            _probe_writable(self.path)
        except OSError as err:
            raise UsageError(
                f"run directory {self.path} is not writable ({err.strerror}); pass a writable --run-dir"
            ) from None
        if not os.access(self.path, os.W_OK):
            raise UsageError(f"run directory {self.path} is not writable; pass a writable --run-dir")
        for file in (self.metrics, self.config, self.environment, self.wandb_run_id, self.lock):
            if (file.exists() or file.is_symlink()) and not file.is_file():
                raise UsageError(f"{file} {missing_file(file)}: the run writes its own file there; remove it")
        for folder in (self.ckpt, self.tb):
            if (folder.exists() or folder.is_symlink()) and not folder.is_dir():
                raise UsageError(f"{folder} {missing_file(folder)}: the run keeps its folder there; remove it")
            if folder.is_dir():  # a read-only mount there would stop the run at its first save, after the epoch
                try:
                    _probe_writable(folder)
                except OSError as err:
                    raise UsageError(
                        f"{folder} is not writable ({err.strerror}); make it writable or pass another --run-dir"
                    ) from None

    def clear_logs(self) -> None:
        """Delete the logs of an earlier attempt (metrics.jsonl, TensorBoard, the W&B run id): `--overwrite`."""
        self.metrics.unlink(missing_ok=True)
        self.wandb_run_id.unlink(missing_ok=True)
        shutil.rmtree(self.tb, ignore_errors=True)

    # ----------------------------------------------------------------------------------------------- reading
    def header(self) -> dict[str, str]:
        """The provenance comments at the top of config.yaml (`# recipe: var`, `# command: ...`); {} without one.

        Raises:
            UsageError: config.yaml exists but cannot be read.
        """
        header: dict[str, str] = {}
        if not self.config.is_file():
            return header
        try:
            with self.config.open(encoding="utf-8", errors="replace") as f:
                for line in f:
                    if not line.startswith("#"):
                        break
                    key, sep, value = line[1:].strip().partition(": ")
                    if sep:
                        header[key] = value.strip()
        except OSError as err:
            raise UsageError(
                f"cannot read {self.config} ({first_line(err)}); fix its permissions, or pass another --run-dir"
            ) from None
        return header

    def recipe(self) -> str | None:
        """The recipe whose run this is (config.yaml's `# recipe:` line), None without one.

        Raises:
            UsageError: config.yaml exists but cannot be read.
        """
        return self.header().get("recipe")

    def read_config(self) -> dict[str, Any]:
        """The resolved config of config.yaml; {} when there is none.

        Raises:
            UsageError: the file cannot be read, or is not a YAML mapping.
        """
        if not self.config.is_file():
            return {}
        text = _read_text(self.config)
        try:
            config = yaml.safe_load(text)
        except (yaml.YAMLError, RecursionError, ValueError) as e:  # ValueError: an int of thousands of digits
            raise UsageError(f"{self.config} is not valid YAML ({type(e).__name__}); fix or delete it") from None
        if config is None:
            return {}
        if not isinstance(config, dict):
            raise UsageError(f"{self.config} is not a YAML mapping")
        return config

    def read_metrics(self, *, skip_damaged: bool = False) -> list[dict[str, Any]]:
        """The rows of metrics.jsonl in file order (duplicates of a resumed run included), "nan" / "inf" strings as
        floats. A truncated last line (a run killed mid-write) is skipped with a warning.

        Args:
            skip_damaged: skip any line that is not a metrics row and read a missing or empty file as no rows (a
                status overview); otherwise those are errors.

        Raises:
            UsageError: (unless `skip_damaged`) the directory or file is missing, the file is empty or not UTF-8, or a
                line before the last is not a JSON object with a "kind".
        """
        if skip_damaged and not self.metrics.is_file():
            return []
        if not self.path.is_dir():
            raise UsageError(f"run directory {self.path} does not exist; pass a directory written by `trainlab train`")
        if not self.metrics.is_file():
            raise UsageError(f"no {METRICS} in {self.path}; pass a run directory written by `trainlab train`")
        if skip_damaged:
            try:
                text = self.metrics.read_text(encoding="utf-8", errors="replace")
            except OSError:
                return []
        else:
            text = _read_text(self.metrics)
        lines = text.splitlines()
        last_content = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
        rows: list[dict[str, Any]] = []
        for i, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except (ValueError, RecursionError) as e:  # not JSON, nested past the parser's depth, a 5000-digit number
                reason = (
                    e.msg
                    if isinstance(e, json.JSONDecodeError)
                    else "nested too deeply"
                    if isinstance(e, RecursionError)
                    else "a number of thousands of digits"
                )
                if skip_damaged:
                    continue
                if i == last_content:
                    log.warning("%s: skipping truncated last line %d (%s)", self.metrics, i + 1, reason)
                    continue
                raise UsageError(
                    f"{self.metrics} line {i + 1} is not valid JSON ({reason}); fix or delete that line"
                ) from None
            if not isinstance(row, dict) or not isinstance(row.get("kind"), str):
                if skip_damaged:
                    continue
                raise UsageError(f'{self.metrics} line {i + 1} is not a metrics row (a JSON object with a "kind")')
            rows.append({k: _NONFINITE.get(v, v) if isinstance(v, str) else v for k, v in row.items()})
        if not rows and not skip_damaged:
            raise UsageError(f"{self.metrics} has no rows yet; has the run logged anything?")
        return rows

    def lock_owner(self) -> str | None:
        """'pid P on HOST' while a process trains in this directory (holds its lock), else None."""
        return lock_owner(self.path)

    # ------------------------------------------------------------------------------------------------ state
    def length(
        self, rows: list[dict[str, Any]], config: dict[str, Any], steps_per_epoch: int | None = None
    ) -> RunLength | None:
        """The run's length as its last launch planned it: from the "start" event it logged (steps per epoch, or the
        schedule's horizon over the epochs), else from `steps_per_epoch` (e.g. read from a checkpoint) with the
        config's epochs and --max-steps; None when neither says.

        Args:
            rows: the run's metrics rows (`read_metrics`).
            config: the run's config (`read_config`).
            steps_per_epoch: optimizer steps per epoch when known from elsewhere.
        """
        epochs, max_steps = config.get("epochs"), config.get("max_steps", -1)
        if not isinstance(epochs, int) or isinstance(epochs, bool) or epochs < 1:
            return None
        start = next((r for r in reversed(rows) if r.get("kind") == "event" and r.get("event") == "start"), None)
        if start is not None:
            total, stop = start.get("total_steps"), start.get("stop_step")
            per_epoch = start.get("steps_per_epoch", total // epochs if _is_int(total) else None)
            if _is_int(per_epoch) and _is_int(total) and _is_int(stop) and per_epoch > 0:
                return RunLength(steps_per_epoch=per_epoch, epochs=epochs, total_steps=total, stop_step=stop)
        if steps_per_epoch is None or steps_per_epoch < 1 or not isinstance(max_steps, int):
            return None
        return run_length(steps_per_epoch, epochs=epochs, max_steps=max_steps)

    def is_finished(
        self,
        rows: list[dict[str, Any]] | None = None,
        config: dict[str, Any] | None = None,
        steps_per_epoch: int | None = None,
    ) -> bool:
        """Whether the run reached its end: a "summary" row at or after its stop step (all epochs, or --max-steps).
        A run stopped by SIGTERM also writes a summary row, before its end: it is not finished.

        Args:
            rows, config: the run's metrics rows and config when already read (else read here, damaged lines
                skipped and an unreadable config taken as none).
            steps_per_epoch: optimizer steps per epoch when known from elsewhere (a checkpoint).
        """
        if rows is None:
            rows = self.read_metrics(skip_damaged=True)
        if config is None:
            try:
                config = self.read_config()
            except UsageError:
                config = {}
        summaries = [r for r in rows if r.get("kind") == "summary"]
        if not summaries:
            return False
        last = summaries[-1]
        length = self.length(rows, config, steps_per_epoch)
        if length is not None and _is_int(last.get("step")) and length.reached_end(last["step"]):
            return True
        epochs = config.get("epochs")
        return _is_int(epochs) and _is_int(last.get("epoch")) and last["epoch"] >= epochs


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _probe_writable(folder: Path) -> None:
    """Create and delete a file of a name of its own in `folder` (a FIFO of a fixed name would block the probe).

    Raises:
        OSError: the folder cannot be written (read-only mount, permissions, full disk).
    """
    with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-test-"):
        pass


def _read_text(path: Path) -> str:
    """The text of a run file, or a one-line UsageError naming it (binary or non-UTF-8 content, unreadable)."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(
            f"{path} is not UTF-8 text (byte {e.start} of {len(e.object)}): the file is damaged; restore or delete it"
        ) from None
    except OSError as e:
        raise UsageError(f"{path} cannot be read ({first_line(e)})") from None
