"""Metric sinks (JSONL = source of truth, TensorBoard, W&B) and progress for people watching; only rank 0 writes.

- `MetricsLogger`: `metrics.jsonl`, TensorBoard, W&B. The W&B run id is kept in `run_dir/wandb_run_id`, so a resumed
  run continues the same W&B run; `--wandb online` without a key is a one-line UsageError (`check_wandb_login`).
- `RunProgress`: one bar for the whole run with its ETA on a terminal; in a log file (nohup, SLURM, `| tee`), a plain
  line every `log_every` steps (step/total, loss, lr, images/s, whole-run ETA) and one per evaluation.
"""

from __future__ import annotations

import contextlib
import json
import logging
import netrc
import os
import secrets
import string
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlparse

from tqdm import tqdm

from trainlab.engine.run_dir import RunDir
from trainlab.errors import UsageError, first_line
from trainlab.json_out import finite_json

log = logging.getLogger(__name__)
progress_log = logging.getLogger("trainlab.progress")

Kind = Literal["train", "eval", "summary", "event", "health"]  # health: trainlab.engine.health, every N steps


def wandb_has_api_key() -> bool:
    """Whether W&B can log in without asking: `WANDB_API_KEY`, or a netrc entry (`wandb login` writes ~/.netrc) for
    the W&B host (`WANDB_BASE_URL`'s, else api.wandb.ai)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname or "api.wandb.ai"
    try:
        entry = netrc.netrc(os.environ.get("NETRC") or None).authenticators(host)
    except (OSError, netrc.NetrcParseError):  # no ~/.netrc, or one that cannot be parsed
        return False
    return bool(entry and entry[2])


def check_wandb_login(mode: str) -> None:
    """Raise a one-line UsageError when `--wandb online` would stop at an interactive login prompt.

    Raises:
        UsageError: mode "online" and no API key (`wandb_has_api_key`).
    """
    if mode == "online" and not wandb_has_api_key():
        raise UsageError(
            "--wandb online needs a W&B API key: run `wandb login` (or set WANDB_API_KEY), or log locally with "
            "--wandb offline and `wandb sync` later"
        )


def _new_wandb_id() -> str:
    """8 random lowercase letters and digits (the form of W&B's own run ids)."""
    alphabet = string.ascii_lowercase + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(8))


def _wandb_run_id(run_dir: Path, new_id: Callable[[], str]) -> str:
    """The W&B run id of this run directory: the stored one (a resumed run continues its W&B run), else a new one,
    stored atomically before the run starts."""
    path = RunDir(run_dir).wandb_run_id
    if path.is_file():
        stored = path.read_text(encoding="utf-8").strip()
        if stored:
            return stored
    run_id = new_id()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(run_id + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return run_id


class MetricsLogger:
    """Writes one JSON object per line to `metrics.jsonl`, mirrors scalars to TensorBoard and (optionally) W&B.

    Args:
        run_dir: the run directory; None writes nothing (ranks other than 0, tests).
        tensorboard: mirror scalars to `run_dir/tb`.
        wandb_mode: "off", "online" (needs an API key: `check_wandb_login`) or "offline" (`wandb sync` later).
        wandb_project: W&B project; '' -> $WANDB_PROJECT, else "trainlab".
        wandb_entity: W&B entity (team or user); '' -> $WANDB_ENTITY, else the account's default.
        run_name: W&B run name; '' -> the run directory's name.
        config: the resolved config, stored with the W&B run.

    The W&B run id is stored in `run_dir/wandb_run_id` and reused (`wandb.init(id=..., resume="allow")`), so a resumed
    run appends to the same W&B run. Deleting that file (as `--overwrite` should) starts a new W&B run.
    """

    def __init__(
        self,
        run_dir: Path | None,
        *,
        tensorboard: bool = True,
        wandb_mode: Literal["off", "online", "offline"] = "off",
        wandb_project: str = "",
        wandb_entity: str = "",
        run_name: str = "",
        config: dict[str, Any] | None = None,
    ) -> None:
        self.enabled = run_dir is not None
        self._jsonl = None
        self._tb = None
        self._wandb = None
        if run_dir is None:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        check_wandb_login(wandb_mode)
        files = RunDir(run_dir)
        self._jsonl = open(files.metrics, "a", buffering=1)  # noqa: SIM115 - closed in close()
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(files.tb))
        if wandb_mode != "off":
            try:
                import wandb
            except ImportError:
                raise UsageError("W&B logging needs the wandb package: pip install 'trainlab[wandb]'") from None
            self._wandb = wandb.init(
                project=wandb_project or os.environ.get("WANDB_PROJECT") or "trainlab",
                entity=wandb_entity or os.environ.get("WANDB_ENTITY") or None,
                name=run_name or run_dir.name,
                id=_wandb_run_id(run_dir, _new_wandb_id),
                dir=str(run_dir),
                mode=wandb_mode,
                config=config or {},
                resume="allow",
            )

    def log(self, kind: Kind, step: int, epoch: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        row = {"kind": kind, "step": step, "epoch": epoch, **finite_json(metrics)}
        assert self._jsonl is not None
        self._jsonl.write(json.dumps(row) + "\n")
        numeric = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self._tb is not None:
            try:
                for key, value in numeric.items():
                    self._tb.add_scalar(f"{kind}/{key}", value, step)
            except OSError as err:  # its folder removed or its disk failing: the run (and metrics.jsonl) go on
                log.warning("TensorBoard logging stopped (%s); metrics.jsonl keeps every row", first_line(err))
                self._close_tensorboard()
        if self._wandb is not None:
            self._wandb.log({f"{kind}/{k}": v for k, v in numeric.items()}, step=step)

    def _close_tensorboard(self) -> None:
        if self._tb is not None:
            writer, self._tb = self._tb, None
            with contextlib.suppress(OSError):  # the folder that failed a write fails the close too
                writer.close()

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        self._close_tensorboard()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def progress(total: int, desc: str, *, enabled: bool = True, initial: int = 0) -> tqdm:
    """A progress bar with rate and ETA on stderr; silent when stderr is not a TTY (CI, nohup, pipes)."""
    return tqdm(
        total=total,
        initial=initial,
        desc=desc,
        dynamic_ncols=True,
        disable=not (enabled and sys.stderr.isatty()),
        leave=False,
    )


def _duration(seconds: float) -> str:
    """`42s`, `3m05s`, `2h07m`, `1d03h`."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    if seconds < 86400:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 86400}d{seconds % 86400 // 3600:02d}h"


def _pick(metrics: dict[str, float], name: str) -> float | None:
    """`metrics[name]`, else the first `<phase>/<name>` (multi-optimizer recipes: `generator/loss`)."""
    if name in metrics:
        return metrics[name]
    return next((v for k, v in metrics.items() if k.endswith("/" + name)), None)


def flops_rate(tflops: float) -> str:
    """`3.21 TFLOP/s`, `412 GFLOP/s`, `1.2 MFLOP/s`: a FLOP rate in the unit that keeps it readable."""
    for unit, scale in (("TFLOP/s", 1.0), ("GFLOP/s", 1e-3), ("MFLOP/s", 1e-6)):
        if tflops >= scale:
            return f"{tflops / scale:.3g} {unit}"
    return f"{tflops * 1e9:.3g} kFLOP/s"


def eta_seconds(steps_done: int, elapsed: float, steps_left: int) -> float | None:
    """Whole-run ETA: the mean time per step of this process so far times the steps left (None before a step)."""
    if steps_done <= 0 or elapsed <= 0:
        return None
    return elapsed / steps_done * steps_left


class RunProgress:
    """Progress of the whole run for people watching it (rank 0 only; build it with `enabled=False` elsewhere).

    On a terminal (stderr is a TTY): one tqdm bar over all the run's optimizer steps, with rate, ETA and the loss.
    Otherwise (nohup, SLURM, `| tee`): a log line (logger `trainlab.progress`, INFO) after every `log_every` steps and
    after the last one, e.g.

        step 120/1000 (12%) | loss 1.234 | lr 1.00e-03 | 512 images/s | 3.2 TFLOP/s | MFU 41.0% | ETA 3m20s

    where images/s (and the achieved TFLOP/s per device and MFU, where `rates` knows them: `engine.throughput`) are
    measured since the previous line and the ETA extrapolates this process's mean time per step (a resumed run counts
    from its resume point). `log_eval` logs every evaluation result in both cases.

    Args:
        total_steps: the optimizer step the run stops at (`RunLength.stop_step`: the end, or --max-steps).
        start_step: steps already done (a resumed run); the bar and the ETA start there.
        batch_size: images per optimizer step (global batch), for images/s.
        enabled: False shows no bar and no step lines (`--progress false`); evaluation lines are still logged.
        log_every: steps between two plain lines.
        is_tty: override the terminal detection (tests); None asks `sys.stderr.isatty()`.
        clock: seconds, monotonic (tests pass a fake one).
        rates: optimizer steps per second -> images_per_second, achieved_tflops, mfu (those known); None: images/s
            from `batch_size`.
    """

    def __init__(
        self,
        total_steps: int,
        start_step: int,
        batch_size: int,
        *,
        enabled: bool,
        log_every: int,
        is_tty: bool | None = None,
        clock: Callable[[], float] = time.perf_counter,
        rates: Callable[[float], dict[str, float]] | None = None,
    ) -> None:
        self.total_steps = total_steps
        self._rates = rates
        self.start_step = start_step
        self.batch_size = batch_size
        self.log_every = max(1, log_every)
        self._clock = clock
        self._t0 = clock()
        self._last_line = (start_step, self._t0)  # (step, time) of the previous plain line
        tty = sys.stderr.isatty() if is_tty is None else is_tty
        self._bar: tqdm | None = None
        self._lines = enabled and not tty
        if enabled and tty:
            self._bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True)

    def update(self, step: int, metrics: dict[str, float]) -> None:
        """Call after every optimizer step with the step count reached (1-based) and that step's metrics."""
        if self._bar is not None:
            self._bar.update(step - self._bar.n)
            if step % self.log_every == 0 or step == self.total_steps:
                loss = _pick(metrics, "loss")
                if loss is not None:
                    self._bar.set_postfix(loss=f"{loss:.4g}", refresh=False)
            return
        if self._lines and (step % self.log_every == 0 or step == self.total_steps):
            progress_log.info("%s", self.line(step, metrics))

    def line(self, step: int, metrics: dict[str, float]) -> str:
        """The plain progress line for `step` (and, as a side effect, the start of the next images/s interval)."""
        now = self._clock()
        parts = [f"step {step}/{self.total_steps} ({100 * step / max(self.total_steps, 1):.0f}%)"]
        loss, lr = _pick(metrics, "loss"), _pick(metrics, "lr")
        if loss is not None:
            parts.append(f"loss {loss:.4g}")
        if lr is not None:
            parts.append(f"lr {lr:.3g}")
        last_step, last_time = self._last_line
        if step > last_step and now > last_time:
            steps_per_second = (step - last_step) / (now - last_time)
            rates = self._rates(steps_per_second) if self._rates is not None else {}
            parts.append(f"{rates.get('images_per_second', steps_per_second * self.batch_size):.4g} images/s")
            if "achieved_tflops" in rates:
                parts.append(flops_rate(rates["achieved_tflops"]))
            if "mfu" in rates:
                parts.append(f"MFU {100 * rates['mfu']:.1f}%")
        self._last_line = (step, now)
        eta = eta_seconds(step - self.start_step, now - self._t0, self.total_steps - step)
        parts.append(f"ETA {_duration(eta)}" if eta is not None else "ETA ?")
        return " | ".join(parts)

    def log_eval(self, epoch: int, metrics: dict[str, float]) -> None:
        """Log one evaluation's results (`eval epoch 3: accuracy 0.9123, loss 0.3`), above the bar on a terminal."""
        shown = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items())
        text = f"eval epoch {epoch}: {shown or 'no metrics'}"
        if self._bar is not None:
            self._bar.clear()
        progress_log.info("%s", text)
        if self._bar is not None:
            self._bar.refresh()

    def close(self) -> None:
        """Close the bar (idempotent)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
