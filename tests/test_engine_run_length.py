"""One definition of a run's length (`engine/run_length.py`): the Trainer, the memory planner and `trainlab runs`
agree that `--max-steps` stops a run early without shortening the schedule's horizon (`StepInfo.total_steps`)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from torch import nn

from trainlab.cli import main
from trainlab.commands.runs import run_state
from trainlab.engine.loop import Trainer
from trainlab.engine.recipe import Batch, StepInfo
from trainlab.engine.run_dir import RunDir
from trainlab.engine.run_length import run_length
from trainlab.memory.trace import PLANNED_TOTAL_STEPS, trace_training
from trainlab.recipes.toy import ToyConfig, ToyRecipe


def test_max_steps_stops_early_and_keeps_the_horizon() -> None:
    assert run_length(8, epochs=3, max_steps=-1) == run_length(8, epochs=3, max_steps=100)
    length = run_length(8, epochs=3, max_steps=10)
    assert (length.total_steps, length.stop_step) == (24, 10)
    assert not length.reached_end(9) and length.reached_end(10)


def _toy(tmp_path: Path, **changes: Any) -> ToyConfig:
    return ToyConfig(run_dir=tmp_path, num_samples=64, batch_size=16, tensorboard=False, progress=False, **changes)


def test_the_trainer_and_its_log_use_it(tmp_path: Path) -> None:
    trainer = Trainer(ToyRecipe(_toy(tmp_path, epochs=3, max_steps=6)))
    assert trainer.step_info().total_steps == 12  # 3 epochs x 4 steps: the schedule's horizon
    assert all(s.total_steps == 12 for s in trainer.schedulers.values())
    result = trainer.fit()
    assert (result.status, result.step) == ("max_steps", 6)
    start = next(r for r in RunDir(tmp_path).read_metrics() if r.get("event") == "start")
    assert (start["steps_per_epoch"], start["total_steps"], start["stop_step"]) == (4, 12, 6)


def test_trainlab_runs_lists_a_max_steps_run_as_finished_at_its_stop_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "runs" / "short"
    args = ["train", "toy", "--run-dir", str(run), "--epochs", "3", "--max-steps", "6", "--num-samples", "64"]
    assert main([*args, "--batch-size", "16", "--tensorboard", "false", "--progress", "false"]) == 0
    state = run_state(run)
    assert (state.status, state.step, state.stop_step, state.total_steps) == ("finished", 6, 6, 12)
    assert RunDir(run).is_finished()
    capsys.readouterr()
    assert main(["runs", str(tmp_path / "runs"), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [(r["status"], r["step"], r["stop_step"]) for r in listed] == [("finished", 6, 6)]


def test_a_run_stopped_by_a_signal_is_not_finished(tmp_path: Path) -> None:
    """An interruption writes a summary row too; `is_finished` (what `trainlab bench` relaunches by) says no."""
    trainer = Trainer(ToyRecipe(_toy(tmp_path, epochs=2)))
    result = trainer.fit(stop_at_step=3)  # saves and ends as an interruption would
    assert result.step == 3
    rows = RunDir(tmp_path).read_metrics()
    assert any(r["kind"] == "summary" for r in rows) and not RunDir(tmp_path).is_finished()
    Trainer(ToyRecipe(_toy(tmp_path, epochs=2))).fit()
    assert RunDir(tmp_path).is_finished()


class _Recording(ToyRecipe):
    """Records the `StepInfo` of every traced micro-step (class-level: the planner builds its own instance)."""

    _seen: list[tuple[int, int]] = []  # noqa: RUF012 - the test's record

    def train_step(self, models: Mapping[str, nn.Module], batch: Batch, phase: str, info: StepInfo) -> dict[str, Any]:
        self._seen.append((info.step, info.total_steps))
        return super().train_step(models, batch, phase, info)


def test_the_planner_traces_the_last_steps_before_max_steps_on_the_long_horizon(tmp_path: Path) -> None:
    _Recording._seen.clear()
    config = dataclasses.replace(_toy(tmp_path, epochs=4, max_steps=50))
    trace_training(_Recording(config), device="cpu", micro_batch=16, grad_accumulation=1)
    horizon = {total for _, total in _Recording._seen}
    assert [step for step, _ in _Recording._seen] == [0, 48, 49]
    assert len(horizon) == 1 and horizon.pop() >= PLANNED_TOTAL_STEPS  # not 50: --max-steps only stops early
