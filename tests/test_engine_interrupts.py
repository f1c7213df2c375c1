"""SIGTERM / SIGHUP to a real training process: it finishes the step, saves last.pt, exits cleanly, and resumes
exactly; SIGHUP is left alone where ignored (`nohup`), and a hung-up terminal does not stop the save."""

from __future__ import annotations

import json
import os
import pty
import select
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

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


def _start(python: str, run_env: dict[str, str], run: Path, step_sleep: float, **popen: Any) -> subprocess.Popen[Any]:
    """The toy run in `run`, slowed to `step_sleep` s a step, in the background (stdout / stderr piped as text unless
    `popen` says otherwise)."""
    streams: dict[str, Any] = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    return subprocess.Popen(
        [python, "-m", "trainlab", *ARGS, "--run-dir", str(run), "--step-sleep-seconds", str(step_sleep)],
        env=run_env,
        **(streams | popen),
    )


def _wait_for_rows(metrics: Path, rows: int, drain: int | None = None) -> None:
    deadline = time.time() + 120
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < rows):
        if drain is not None and select.select([drain], [], [], 0.05)[0]:
            os.read(drain, 65536)  # a terminal's output is read, or its buffer fills and the run blocks
        else:
            time.sleep(0.05)


@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGHUP])
def test_a_stop_signal_saves_and_resumes(
    tmp_path: Path, python: str, run_env: dict[str, str], stop_signal: signal.Signals
) -> None:
    straight = tmp_path / "straight"
    subprocess.run(
        [python, "-m", "trainlab", *ARGS, "--run-dir", str(straight)],
        env=run_env,
        check=True,
        capture_output=True,
        timeout=300,
    )

    run = tmp_path / "run"
    proc = _start(python, run_env, run, 0.1)
    _wait_for_rows(run / "metrics.jsonl", 3)
    proc.send_signal(stop_signal)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    assert f"{stop_signal.name} received" in err and "run the same command again to resume" in err
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


def test_sighup_is_left_alone_where_ignored(tmp_path: Path, python: str, run_env: dict[str, str]) -> None:
    # nohup: the process starts with SIGHUP ignored, and training keeps it so
    run = tmp_path / "run"
    proc = _start(python, run_env, run, 0.05, preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    _wait_for_rows(run / "metrics.jsonl", 3)
    proc.send_signal(signal.SIGHUP)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    assert "SIGHUP" not in err
    assert load_checkpoint(run / "ckpt" / "last.pt")["step"] == 32  # trained to the end


def test_a_hung_up_terminal_still_saves(tmp_path: Path, python: str, run_env: dict[str, str]) -> None:
    # the run's stdout and stderr are a terminal (its progress bar draws there); the terminal goes away, then SIGHUP
    # arrives: the bar's next write would fail (EIO), so the streams are pointed at /dev/null and the step is saved
    primary, secondary = pty.openpty()
    run = tmp_path / "run"
    proc = _start(python, run_env, run, 0.1, stdin=subprocess.DEVNULL, stdout=secondary, stderr=secondary, text=False)
    os.close(secondary)
    _wait_for_rows(run / "metrics.jsonl", 3, drain=primary)
    os.close(primary)  # the terminal hangs up: writes to it fail from now on
    proc.send_signal(signal.SIGHUP)
    assert proc.wait(timeout=120) == 0
    stopped_at = load_checkpoint(run / "ckpt" / "last.pt")["step"]
    assert 3 <= stopped_at < 32


@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_to_the_whole_process_group_with_loader_workers_saves(
    tmp_path: Path, python: str, run_env: dict[str, str], stop_signal: signal.Signals
) -> None:
    """`docker stop`, `scancel`, a terminal's Ctrl-C: the signal reaches the loader workers too. They leave it to the
    training process, which finishes its step and saves it (killed, they made the loader raise "DataLoader worker
    ... is killed by signal", and the steps since the last save were lost)."""
    run = tmp_path / "run"
    command = [python, "-m", "trainlab", *ARGS, "--num-workers", "2", "--step-sleep-seconds", "0.1"]
    proc = subprocess.Popen(
        [*command, "--run-dir", str(run)], env=run_env, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    _wait_for_rows(run / "metrics.jsonl", 4)
    os.killpg(proc.pid, stop_signal)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and "Traceback" not in err, err[-2000:]
    assert "interrupted at step" in err.strip().splitlines()[-1], err[-2000:]
    assert load_checkpoint(run / "ckpt" / "last.pt")["step"] == len(_train_losses(run))


def test_a_second_ctrl_c_waits_for_the_checkpoint_being_written() -> None:
    """Raised inside torch.save, the KeyboardInterrupt cut the file and surfaced as torch's RuntimeError (a traceback,
    exit 1): while a checkpoint is written it is put off; the run exits right after the save, as the first asked."""
    from trainlab.engine.signals import deferring_interrupts, graceful_stop

    with graceful_stop() as stop:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
        assert stop.requested
        with deferring_interrupts():
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C again, during the write
            time.sleep(0.05)
        with pytest.raises(KeyboardInterrupt):  # outside a save the second Ctrl-C still stops at once
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
