"""Progress for people watching a run (plain lines without a terminal, one bar for the whole run with one) and the
W&B sink (project / entity / name resolution, the run id kept across a resume, no interactive login prompt)."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import pytest

from trainlab.engine import metrics as metrics_module
from trainlab.engine.metrics import (
    MetricsLogger,
    RunProgress,
    check_wandb_login,
    eta_seconds,
    wandb_has_api_key,
)
from trainlab.engine.run_dir import RunDir
from trainlab.errors import UsageError


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "trainlab.progress"]


def test_plain_lines_every_log_every_steps_with_rate_and_whole_run_eta(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="trainlab.progress")
    clock = _Clock()
    progress = RunProgress(10, 0, 32, enabled=True, log_every=4, is_tty=False, clock=clock)
    for step in range(1, 11):
        clock.now += 0.5  # 0.5 s per step: 64 images/s
        progress.update(step, {"loss": 2.0 / step, "lr": 0.001, "grad_norm": 1.0})
    progress.log_eval(1, {"accuracy": 0.91234, "loss": 0.5})
    progress.close()
    assert _lines(caplog) == [
        "step 4/10 (40%) | loss 0.5 | lr 0.001 | 64 images/s | ETA 3s",
        "step 8/10 (80%) | loss 0.25 | lr 0.001 | 64 images/s | ETA 1s",
        "step 10/10 (100%) | loss 0.2 | lr 0.001 | 64 images/s | ETA 0s",  # the last step always gets a line
        "eval epoch 1: accuracy 0.9123, loss 0.5",
    ]


def test_resumed_run_counts_its_eta_from_the_resume_point(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="trainlab.progress")
    clock = _Clock()
    progress = RunProgress(1000, 400, 8, enabled=True, log_every=100, is_tty=False, clock=clock)
    for step in range(401, 501):
        clock.now += 2.0
        progress.update(step, {"generator/loss": 1.5, "generator/lr": 2e-4, "discriminator/loss": 0.7})
    # 100 steps in 200 s, 500 left: 1000 s; the phase-prefixed keys of a multi-optimizer recipe are found
    assert _lines(caplog) == ["step 500/1000 (50%) | loss 1.5 | lr 0.0002 | 4 images/s | ETA 16m40s"]


def test_eta_arithmetic() -> None:
    assert eta_seconds(0, 10.0, 5) is None
    assert eta_seconds(10, 5.0, 90) == pytest.approx(45.0)
    assert metrics_module._duration(59.4) == "59s" and metrics_module._duration(3725) == "1h02m"
    assert metrics_module._duration(2 * 86400 + 3 * 3600) == "2d03h"


def test_disabled_progress_logs_only_evaluations(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="trainlab.progress")
    progress = RunProgress(4, 0, 8, enabled=False, log_every=1, is_tty=False)
    for step in range(1, 5):
        progress.update(step, {"loss": 1.0})
    progress.log_eval(2, {"psnr": 20.0})
    assert _lines(caplog) == ["eval epoch 2: psnr 20"]


def test_a_terminal_gets_one_bar_for_the_whole_run(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="trainlab.progress")
    progress = RunProgress(12, 3, 8, enabled=True, log_every=2, is_tty=True)
    bar = progress._bar
    assert bar is not None and bar.total == 12 and bar.n == 3  # all epochs, starting at the resume point
    for step in range(4, 13):
        progress.update(step, {"loss": 0.25})
    assert bar.n == 12 and "loss=0.25" in str(bar)
    assert _lines(caplog) == []  # no plain lines next to a bar
    progress.close()
    progress.close()


# ------------------------------------------------------------------------------------------------ W&B


def test_online_without_a_key_is_a_one_line_usage_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_BASE_URL", raising=False)
    netrc_file = tmp_path / "netrc"
    netrc_file.write_text("machine example.com login me password secret\n")
    monkeypatch.setenv("NETRC", str(netrc_file))
    assert not wandb_has_api_key()
    with pytest.raises(UsageError, match=r"`wandb login`.*--wandb offline") as info:
        MetricsLogger(tmp_path / "run", tensorboard=False, wandb_mode="online")
    assert "\n" not in str(info.value)
    check_wandb_login("offline")  # offline and off never need a key
    netrc_file.write_text("machine api.wandb.ai login user password 0123456789abcdef\n")
    assert wandb_has_api_key()
    netrc_file.write_text("")
    monkeypatch.setenv("WANDB_API_KEY", "0123456789abcdef")
    check_wandb_login("online")


class _FakeRun:
    def log(self, data: dict[str, float], step: int) -> None:
        pass

    def finish(self) -> None:
        pass


def test_project_entity_and_name_resolution(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wandb = pytest.importorskip("wandb")
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(wandb, "init", lambda **kwargs: calls.append(kwargs) or _FakeRun())
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    monkeypatch.delenv("WANDB_ENTITY", raising=False)
    run_dir = tmp_path / "cifar-bf16"
    MetricsLogger(run_dir, tensorboard=False, wandb_mode="offline").close()
    monkeypatch.setenv("WANDB_PROJECT", "from-env")
    monkeypatch.setenv("WANDB_ENTITY", "team-env")
    MetricsLogger(run_dir, tensorboard=False, wandb_mode="offline").close()
    MetricsLogger(
        run_dir, tensorboard=False, wandb_mode="offline", wandb_project="p", wandb_entity="e", run_name="n"
    ).close()
    picked = [(c["project"], c["entity"], c["name"]) for c in calls]
    assert picked == [
        ("trainlab", None, "cifar-bf16"),
        ("from-env", "team-env", "cifar-bf16"),
        ("p", "e", "n"),
    ]
    stored = RunDir(run_dir).wandb_run_id.read_text().strip()
    assert len(stored) == 8 and all(c["id"] == stored and c["resume"] == "allow" for c in calls)


def test_a_resumed_run_continues_the_same_wandb_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    run_dir = tmp_path / "run"
    for step in (1, 2):  # the first launch, then its resume
        logger = MetricsLogger(run_dir, tensorboard=False, wandb_mode="offline")
        logger.log("train", step, 0, {"loss": 1.0 / step})
        logger.close()
    run_id = RunDir(run_dir).wandb_run_id.read_text().strip()
    offline_runs = sorted((run_dir / "wandb").glob("offline-run-*"))
    # wandb names offline runs offline-run-<time>-<id>, adding -1, -2 when two start within the same second
    assert offline_runs and all(re.search(rf"-{run_id}(-\d+)?$", p.name) for p in offline_runs)
