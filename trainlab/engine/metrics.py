"""Metric sinks (JSONL = source of truth, TensorBoard, W&B) and the console progress bar; only rank 0 writes."""

from __future__ import annotations

import json
import logging
import math
import sys
from pathlib import Path
from typing import Any, Literal

from tqdm import tqdm

log = logging.getLogger(__name__)

Kind = Literal["train", "eval", "summary", "event"]


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no inf/nan; keep them visible rather than dropping the row
    return value


class MetricsLogger:
    """Writes one JSON object per line to `metrics.jsonl`, mirrors scalars to TensorBoard and (optionally) W&B."""

    def __init__(
        self,
        run_dir: Path | None,
        *,
        tensorboard: bool = True,
        wandb_mode: Literal["off", "online", "offline"] = "off",
        wandb_project: str = "trainlab",
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
        self._jsonl = open(run_dir / "metrics.jsonl", "a", buffering=1)  # noqa: SIM115 - closed in close()
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(run_dir / "tb"))
        if wandb_mode != "off":
            try:
                import wandb
            except ImportError:
                from trainlab.errors import UsageError

                raise UsageError("W&B logging needs the wandb package: pip install 'trainlab[wandb]'") from None
            self._wandb = wandb.init(
                project=wandb_project,
                name=run_name or run_dir.name,
                dir=str(run_dir),
                mode=wandb_mode,
                config=config or {},
                resume="allow",
            )

    def log(self, kind: Kind, step: int, epoch: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        row = {"kind": kind, "step": step, "epoch": epoch, **{k: _clean(v) for k, v in metrics.items()}}
        assert self._jsonl is not None
        self._jsonl.write(json.dumps(row) + "\n")
        numeric = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self._tb is not None:
            for key, value in numeric.items():
                self._tb.add_scalar(f"{kind}/{key}", value, step)
        if self._wandb is not None:
            self._wandb.log({f"{kind}/{k}": v for k, v in numeric.items()}, step=step)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
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
