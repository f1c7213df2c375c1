"""Runs a user can trust: a relaunch never destroys work, crashes leave a consistent ckpt/, NaN stops the run,
an epoch-end preemption keeps the epoch, resume refuses silent changes, one process per run dir, keep-last-K."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import with_fields

from trainlab.engine.checkpoint import CheckpointStore, load_checkpoint
from trainlab.engine.loop import Trainer
from trainlab.engine.run_lock import RunDirLock
from trainlab.errors import TrainingStopped, UsageError
from trainlab.recipes.toy import ToyConfig, ToyRecipe


def _config(run_dir: Path, **overrides: Any) -> ToyConfig:
    """The small toy run, with fields changed (`optim.learning_rate`: a field of the optimizer group)."""
    base = ToyConfig(
        run_dir=run_dir, num_samples=64, batch_size=16, epochs=2, log_every=1, tensorboard=False, progress=False
    )
    return with_fields(base, overrides)


def _step(path: Path) -> int:
    return int(load_checkpoint(path)["step"])


def test_relaunching_the_same_command_resumes_instead_of_overwriting(tmp_path: Path) -> None:
    Trainer(ToyRecipe(_config(tmp_path, epochs=2))).fit()
    assert _step(tmp_path / "ckpt" / "last.pt") == 8
    rows_before = (tmp_path / "metrics.jsonl").read_text().count('"kind": "train"')
    result = Trainer(ToyRecipe(_config(tmp_path, epochs=2))).fit()  # the same command again
    assert result.step == 8 and result.losses == []  # nothing retrained, nothing overwritten
    assert _step(tmp_path / "ckpt" / "last.pt") == 8
    assert (tmp_path / "metrics.jsonl").read_text().count('"kind": "train"') == rows_before


def test_resume_never_refuses_a_run_dir_with_a_checkpoint_and_overwrite_starts_over(tmp_path: Path) -> None:
    Trainer(ToyRecipe(_config(tmp_path, epochs=1))).fit()
    with pytest.raises(UsageError, match=r"holds a checkpoint.*--overwrite"):
        Trainer(ToyRecipe(_config(tmp_path, epochs=1, resume="never"))).fit()
    assert _step(tmp_path / "ckpt" / "last.pt") == 4
    result = Trainer(ToyRecipe(_config(tmp_path, epochs=2, overwrite=True))).fit()
    assert result.step == 8 and len(result.losses) == 8
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "train"] == list(range(1, 9))  # old rows gone


class _Improving(ToyRecipe):
    """Every evaluation is a new best."""

    def evaluate(self, models: Any, device: torch.device, epoch: int) -> dict[str, float]:
        return {"accuracy": float(epoch)}


def test_best_pt_is_repaired_after_a_kill_between_last_and_best(tmp_path: Path) -> None:
    Trainer(_Improving(_config(tmp_path, epochs=2, max_steps=4))).fit()
    ckpt = tmp_path / "ckpt"
    stale = torch.load(ckpt / "best.pt", weights_only=True)
    Trainer(_Improving(_config(tmp_path, epochs=2))).fit()
    last = torch.load(ckpt / "last.pt", weights_only=True)
    assert last["best_step"] == last["step"] == 8
    torch.save(stale, ckpt / "best.pt")  # what a SIGKILL between the last.pt rename and the best.pt copy leaves
    Trainer(_Improving(_config(tmp_path, epochs=2))).fit()  # a relaunch repairs it
    assert torch.load(ckpt / "best.pt", weights_only=True)["step"] == 8


def test_temp_files_of_killed_saves_are_removed_at_start(tmp_path: Path) -> None:
    Trainer(ToyRecipe(_config(tmp_path, epochs=2, max_steps=4))).fit()
    junk = tmp_path / "ckpt" / ".last.pt.abc123.tmp"
    junk.write_bytes(b"half a checkpoint")
    Trainer(ToyRecipe(_config(tmp_path, epochs=2))).fit()
    assert not list((tmp_path / "ckpt").glob(".*.tmp"))


def test_nan_stops_the_run_and_keeps_the_last_finite_checkpoint(tmp_path: Path) -> None:
    Trainer(ToyRecipe(_config(tmp_path, epochs=2, max_steps=4))).fit()
    before = (tmp_path / "ckpt" / "last.pt").read_bytes()

    class Diverging(ToyRecipe):  # the resumed run diverges at its first step (a NaN loss, as a huge lr gives)
        def train_step(self, models: Any, batch: Any, phase: str, info: Any) -> dict[str, Any]:
            out = super().train_step(models, batch, phase, info)
            return {**out, "loss": out["loss"] * math.nan}

    with pytest.raises(TrainingStopped, match=r"diverged at step 5"):
        Trainer(Diverging(_config(tmp_path, epochs=2))).fit()
    assert (tmp_path / "ckpt" / "last.pt").read_bytes() == before
    state = torch.load(tmp_path / "ckpt" / "last.pt", weights_only=True)
    assert all(bool(t.isfinite().all()) for t in state["models"]["model"].values())


def test_overflow_skips_are_tolerated_up_to_the_patience_then_stop(tmp_path: Path) -> None:
    cfg = _config(tmp_path, precision="bf16-amp-scale", epochs=2, max_skipped_steps=2, **{"optim.learning_rate": 1e30})
    with pytest.raises(TrainingStopped, match=r"3 optimizer steps in a row skipped"):
        Trainer(ToyRecipe(cfg)).fit()


@pytest.mark.parametrize("flag", ["optim.learning_rate", "static_loss_scale", "clip_grad_norm"])
def test_nan_and_negative_settings_are_usage_errors(tmp_path: Path, flag: str) -> None:
    with pytest.raises(UsageError, match="finite"):
        _config(tmp_path, **{flag: math.nan}).validate()
    if flag != "static_loss_scale":
        with pytest.raises(UsageError, match=flag.replace("_", "-")):
            _config(tmp_path, **{flag: -2.0}).validate()


def test_epoch_end_preemption_saves_before_evaluating_and_evaluates_after_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    evaluated: list[int] = []

    class SlowEval(ToyRecipe):
        def evaluate(self, models: Any, device: torch.device, epoch: int) -> dict[str, float]:
            evaluated.append(epoch)
            if epoch == 1 and len(evaluated) == 1:
                os.kill(os.getpid(), signal.SIGTERM)  # the notice arrives at the epoch end
                raise KeyboardInterrupt  # a grace period shorter than the evaluation: it never finishes
            return super().evaluate(models, device, epoch)

    with pytest.raises(KeyboardInterrupt):
        Trainer(SlowEval(_config(tmp_path, epochs=2))).fit()
    state = torch.load(tmp_path / "ckpt" / "last.pt", weights_only=True)
    assert state["step"] == 4 and state["eval_pending"]  # the epoch is safe although its evaluation never ran
    result = Trainer(SlowEval(_config(tmp_path, epochs=2))).fit()
    assert evaluated == [1, 1, 2] and result.step == 8


def test_resume_refuses_silent_changes_and_applies_allowed_ones(tmp_path: Path, caplog: Any) -> None:
    Trainer(ToyRecipe(_config(tmp_path, epochs=2, max_steps=4))).fit()
    linear = dataclasses.replace(ToyConfig().schedule, kind="linear")
    for change in ({"optim.weight_decay": 0.1}, {"schedule": linear}, {"epochs": 3}, {"dropout": 0.5}):
        with pytest.raises(UsageError, match="resume with the same"):
            Trainer(ToyRecipe(_config(tmp_path, **{"epochs": 2, **change}))).fit()
    with caplog.at_level("INFO"):
        result = Trainer(ToyRecipe(_config(tmp_path, epochs=2, max_steps=6, clip_grad_norm=1.0))).fit()
    assert result.step == 6 and "max_steps 4 -> 6" in caplog.text and "clip_grad_norm 0.0 -> 1.0" in caplog.text


def test_max_steps_is_a_stopping_point_not_the_schedule_horizon(tmp_path: Path) -> None:
    cosine = dataclasses.replace(ToyConfig().schedule, kind="cosine")
    short = Trainer(ToyRecipe(_config(tmp_path / "a", epochs=2, max_steps=4, schedule=cosine)))
    full = Trainer(ToyRecipe(_config(tmp_path / "b", epochs=2, schedule=cosine)))
    assert short.length.total_steps == full.length.total_steps == 8 and short.length.stop_step == 4
    assert short.fit().losses == full.fit().losses[:4]


def test_a_second_process_on_the_same_run_dir_is_refused(tmp_path: Path) -> None:
    code = (
        "import sys, time; from pathlib import Path; from trainlab.engine.run_lock import RunDirLock; "
        "lock = RunDirLock(Path(sys.argv[1])); lock.acquire(); print('locked', flush=True); time.sleep(60)"
    )
    holder = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        with pytest.raises(UsageError, match=rf"in use by pid {holder.pid} on host"):
            Trainer(ToyRecipe(_config(tmp_path))).fit()
    finally:
        holder.kill()
        holder.wait()
    with RunDirLock(tmp_path):  # a killed owner leaves no stale lock
        pass


def test_the_lock_knows_whether_its_run_directory_is_still_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "run"
    with RunDirLock(run) as lock:
        assert lock.in_place()
        real_stat = os.stat
        # a file system whose inode numbers change between calls (some FUSE mounts): the lock's text decides
        monkeypatch.setattr(os, "stat", lambda p, *a, **k: os.stat_result((0, 12345, *real_stat(p)[2:])))
        assert lock.in_place()
        monkeypatch.undo()
        run.rename(tmp_path / "moved")
        assert not lock.in_place()  # moved away
        run.mkdir()
        (run / ".lock").write_text('{"pid": 1}')
        assert not lock.in_place()  # another lock file at the old place
        (run / ".lock").unlink()
        assert not lock.in_place()


def test_keep_last_k_and_fallback_when_last_is_corrupt(tmp_path: Path, caplog: Any) -> None:
    Trainer(ToyRecipe(_config(tmp_path, epochs=2, checkpoint_every=1, keep_checkpoints=3))).fit()
    store = CheckpointStore(tmp_path / "ckpt", keep=3)
    assert [p.name for p in store.history()] == [f"step_{s:09d}.pt" for s in (6, 7, 8)]
    (tmp_path / "ckpt" / "last.pt").write_bytes(b"corrupt")  # e.g. a disk error after the rename
    (tmp_path / "ckpt" / "step_000000008.pt").write_bytes(b"corrupt")
    with caplog.at_level("WARNING"):
        state, path = store.load_latest()
    assert path.name == "step_000000007.pt" and state["step"] == 7 and "unreadable" in caplog.text


def test_a_full_disk_is_one_line_and_keeps_the_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    Trainer(ToyRecipe(_config(tmp_path, epochs=2, max_steps=4))).fit()
    before = (tmp_path / "ckpt" / "last.pt").read_bytes()

    def full(*args: Any, **kwargs: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(UsageError, match=r"No space left on device.*previous checkpoint is intact"):
        Trainer(ToyRecipe(_config(tmp_path, epochs=2))).fit()
    assert (tmp_path / "ckpt" / "last.pt").read_bytes() == before
    assert not list((tmp_path / "ckpt").glob(".*.tmp"))


def test_fake_cifar_generation_is_atomic_and_concurrent_safe(tmp_path: Path) -> None:
    code = (
        "import sys; from trainlab.data.fake_cifar import write_fake_cifar10; "
        "write_fake_cifar10(sys.argv[1], num_train=200, num_test=50, seed=0)"
    )
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)]) for _ in range(3)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0, 0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cifar-10-batches-py"]  # no temp folders left
    from trainlab.data.cifar import load_cifar10

    assert len(load_cifar10(tmp_path, train=True)) == 200
    time.sleep(0)
