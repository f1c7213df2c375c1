"""SIGTERM to a real training process: it finishes the step, saves last.pt, exits cleanly, and resumes exactly."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

from trainlab.engine.checkpoint import load_checkpoint

ARGS = [
    "train",
    "toy",
    "--num-samples",
    "256",
    "--batch-size",
    "16",
    "--epochs",
    "2",
    "--log-every",
    "1",
    "--tensorboard",
    "false",
    "--dropout",
    "0.1",
    "--seed",
    "9",
    "--device",
    "cpu",
]


def _train_losses(run_dir: Path) -> list[float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if r["kind"] == "train"]


def test_sigterm_saves_and_resumes(tmp_path: Path, python: str, run_env: dict[str, str]) -> None:
    straight = tmp_path / "straight"
    subprocess.run(
        [python, "-m", "trainlab", *ARGS, "--run-dir", str(straight)],
        env=run_env,
        check=True,
        capture_output=True,
        timeout=300,
    )

    run = tmp_path / "run"
    proc = subprocess.Popen(
        [python, "-m", "trainlab", *ARGS, "--run-dir", str(run), "--step-sleep-seconds", "0.1"],
        env=run_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    metrics = run / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 3):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    assert "SIGTERM received" in err and "run the same command again to resume" in err
    state = load_checkpoint(run / "ckpt" / "last.pt")
    stopped_at = state["step"]
    assert 0 < stopped_at < 32

    resumed = subprocess.run(
        [python, "-m", "trainlab", *ARGS, "--run-dir", str(run), "--resume", "auto"],
        env=run_env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert load_checkpoint(run / "ckpt" / "last.pt")["step"] == 32
    # the JSONL of the interrupted+resumed run has the same per-step losses as the straight run
    assert _train_losses(run) == _train_losses(straight)
    final_a = load_checkpoint(straight / "ckpt" / "last.pt")["models"]["model"]
    final_b = load_checkpoint(run / "ckpt" / "last.pt")["models"]["model"]
    assert all(final_a[k].equal(final_b[k]) for k in final_a)
