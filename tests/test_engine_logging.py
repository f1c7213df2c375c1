"""Logging sinks: JSONL (source of truth), TensorBoard event files, W&B in offline mode, config provenance."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from trainlab.engine.loop import Trainer
from trainlab.recipes.toy import ToyConfig, ToyRecipe


def test_jsonl_tensorboard_and_config(tmp_path: Path) -> None:
    Trainer(ToyRecipe(ToyConfig(run_dir=tmp_path, num_samples=64, batch_size=16, epochs=2, log_every=2))).fit()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    kinds = [r["kind"] for r in rows]
    assert kinds.count("eval") == 2 and kinds[-1] == "summary"
    assert [r["step"] for r in rows if r["kind"] == "train"] == [1, 2, 4, 6, 8]
    summary = rows[-1]
    assert summary["memory_kind"] == "cpu_peak_rss" and summary["peak_memory_bytes"] > 10_000_000
    assert summary["seconds_per_epoch"] > 0 and summary["epochs_timed"] == 1
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    config = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert config["batch_size"] == 16
    env = yaml.safe_load((tmp_path / "environment.yaml").read_text())
    assert env["recipe"] == "toy" and env["torch"] and env["git_sha"]


def test_wandb_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    cfg = ToyConfig(
        run_dir=tmp_path, num_samples=32, batch_size=16, epochs=1, log_every=1, wandb="offline", tensorboard=False
    )
    try:
        Trainer(ToyRecipe(cfg)).fit()
    finally:
        wandb.teardown()  # stop the service process this test started (its exit hook fails once later tests have run)
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert runs, list(tmp_path.rglob("*"))[:20]
    assert list(runs[0].glob("*.wandb"))


def test_a_tensorboard_folder_removed_mid_run_stops_tensorboard_not_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Its writes failing (the tb/ folder removed, its disk failing) ended the run without a save."""
    from torch.utils.tensorboard import SummaryWriter

    writes = {"n": 0}
    real = SummaryWriter.add_scalar

    def failing_after_a_while(self: SummaryWriter, *args: object, **kwargs: object) -> None:
        writes["n"] += 1
        if writes["n"] > 20:
            raise FileNotFoundError(2, "No such file or directory", "tb/events.out.tfevents")
        real(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(SummaryWriter, "add_scalar", failing_after_a_while)
    cfg = ToyConfig(run_dir=tmp_path, num_samples=64, batch_size=16, epochs=2, log_every=1, tensorboard=True)
    assert Trainer(ToyRecipe(cfg)).fit().step == 8
    assert "TensorBoard logging stopped" in caplog.text
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert sum(row["kind"] == "train" for row in rows) == 8
