"""Chaos: a real `trainlab train` process SIGKILLed at random points, several of them in the middle of a checkpoint
write, relaunched with the same command each time. The finished run must equal an uninterrupted one bit for bit
(weights, optimizer, every RNG, best.pt), every checkpoint must load after every kill, and no stray file remains."""

from __future__ import annotations

import random
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from trainlab.engine.checkpoint import load_checkpoint

ARGS = [
    "train", "toy", "--num-samples", "192", "--batch-size", "16", "--epochs", "3", "--num-features", "256",
    "--hidden", "768", "--dropout", "0.1", "--checkpoint-every", "1", "--log-every", "1", "--tensorboard", "false",
    "--progress", "false", "--step-sleep-seconds", "0.03", "--seed", "5",
]  # fmt: skip


def _launch(python: str, run_dir: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [python, "-m", "trainlab", *ARGS, "--run-dir", str(run_dir)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return bool(a == b)


def _kill_during_a_write(proc: subprocess.Popen[str], ckpt: Path, timeout: float = 20.0) -> bool:
    """SIGKILL as soon as a checkpoint temp file exists. Returns False if the process ended first."""
    end = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < end:
        if ckpt.is_dir() and any(ckpt.glob(".*.tmp")):
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            return True
        time.sleep(0.0005)
    return False


def _chaos(python: str, run_env: dict[str, str], tmp_path: Path, kills: int, seed: int) -> None:
    reference = tmp_path / "reference"
    done = subprocess.run(
        [python, "-m", "trainlab", *ARGS, "--run-dir", str(reference)], env=run_env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rng = random.Random(seed)
    run = tmp_path / "chaos"
    ckpt = run / "ckpt"
    during_write = 0
    for i in range(kills):
        proc = _launch(python, run, run_env)
        if i % 2 == 0 and _kill_during_a_write(proc, ckpt):
            during_write += 1
        else:
            time.sleep(rng.uniform(3.0, 6.0))  # start-up (imports) takes ~3 s: kill inside the training
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        for path in sorted(ckpt.glob("*.pt")) if ckpt.is_dir() else []:
            load_checkpoint(path)  # every checkpoint on disk is whole after every kill
    assert during_write >= 1, "no kill landed inside a checkpoint write"
    final = subprocess.run(
        [python, "-m", "trainlab", *ARGS, "--run-dir", str(run)], env=run_env, capture_output=True, text=True
    )
    assert final.returncode == 0, final.stderr[-2000:]
    ours, ref = load_checkpoint(ckpt / "last.pt"), load_checkpoint(reference / "ckpt" / "last.pt")
    assert ours["step"] == ref["step"] == 36
    for key in ("models", "optimizers", "schedulers", "rng_per_rank", "best_score", "best_step", "recipe_state"):
        assert _equal(ours[key], ref[key]), key
    best, ref_best = load_checkpoint(ckpt / "best.pt"), load_checkpoint(reference / "ckpt" / "best.pt")
    assert best["step"] == ref_best["step"] and _equal(best["models"], ref_best["models"])
    stray = [p.name for p in ckpt.iterdir() if not (p.name in ("last.pt", "best.pt") or p.name.startswith("step_"))]
    assert stray == [] and len(list(ckpt.glob("step_*.pt"))) == 2  # keep-last-2


def test_chaos_short(python: str, run_env: dict[str, str], tmp_path: Path) -> None:
    _chaos(python, run_env, tmp_path, kills=4, seed=0)


@pytest.mark.slow
def test_chaos_long(python: str, run_env: dict[str, str], tmp_path: Path) -> None:
    _chaos(python, run_env, tmp_path, kills=14, seed=1)
