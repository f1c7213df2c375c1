"""The fraction of training time spent waiting for data: the clock around the loader iterator, and the engine's
`data_wait_fraction` in the training rows and the summary."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from trainlab.cli import main
from trainlab.engine.data_wait import DataWaitClock


def _slow(n: int, seconds: float) -> Iterator[int]:
    for i in range(n):
        time.sleep(seconds)
        yield i


def test_the_clock_counts_the_time_inside_next_only() -> None:
    clock = DataWaitClock(_slow(4, 0.02))
    for _ in clock:
        time.sleep(0.02)  # the "step": not waiting for data
    assert 0.07 < clock.waited < 0.16
    assert clock.window_fraction() == pytest.approx(0.5, abs=0.2)
    assert clock.window_fraction() < 0.1  # a new window: no waiting since the last call


def test_training_logs_the_data_wait_fraction(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    argv = ["train", "toy", "--epochs", "2", "--run-dir", str(run_dir), "--tensorboard", "false"]
    assert main([*argv, "--progress", "false", "--log-every", "1"]) == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [row for row in rows if row["kind"] == "train"]
    assert train and all(0.0 <= row["data_wait_fraction"] <= 1.0 for row in train)
    summary = [row for row in rows if row["kind"] == "summary"][-1]
    assert 0.0 < summary["data_wait_fraction"] < 1.0
