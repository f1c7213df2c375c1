"""Real 2-process gloo runs through torchrun: 2 x 8 equals 1 x 16; one process never makes a process group."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import needs_compiler

from trainlab import dist
from trainlab.engine.checkpoint import load_checkpoint
from trainlab.engine.loop import Trainer
from trainlab.recipes.toy import ToyConfig, ToyRecipe

COMMON = [
    "train",
    "toy",
    "--batch-size",
    "16",
    "--num-samples",
    "64",
    "--epochs",
    "2",
    "--max-steps",
    "5",
    "--device",
    "cpu",
    "--log-every",
    "1",
    "--tensorboard",
    "false",
    "--seed",
    "4",
]


def _train_one_process(python: str, run_dir: Path, env: dict[str, str]) -> None:
    """The reference: the same run in one process, global batch 16, no accumulation."""
    subprocess.run(
        [python, "-m", "trainlab", *COMMON, "--run-dir", str(run_dir)],
        env=env,
        check=True,
        capture_output=True,
        timeout=300,
    )


def test_single_process_creates_no_process_group(tmp_path: Path) -> None:
    trainer = Trainer(ToyRecipe(ToyConfig(run_dir=tmp_path, num_samples=32, batch_size=16, tensorboard=False)))
    trainer.fit()
    assert not torch.distributed.is_initialized()
    assert dist.world_size() == 1 and dist.rank() == 0
    x = torch.ones(3, requires_grad=True)
    assert dist.all_gather_with_grad(x) is x


def test_two_processes_equal_one_process(tmp_path: Path, python: str, run_env: dict[str, str]) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    _train_one_process(python, one, run_env)
    launched = subprocess.run(
        [
            python,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "trainlab",
            *COMMON,
            "--run-dir",
            str(two),
        ],
        env=run_env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert launched.returncode == 0, launched.stderr[-3000:]
    assert "backend=gloo rank=0 world_size=2" in launched.stderr
    a = load_checkpoint(one / "ckpt" / "last.pt")["models"]["model"]
    b = load_checkpoint(two / "ckpt" / "last.pt")["models"]["model"]
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-5)
    rows = [json.loads(x) for x in (two / "metrics.jsonl").read_text().splitlines()]
    assert len([r for r in rows if r["kind"] == "train"]) == 5  # only rank 0 writes, once per step
    losses_one = [
        json.loads(x)["loss"]
        for x in (one / "metrics.jsonl").read_text().splitlines()
        if json.loads(x)["kind"] == "train"
    ]
    losses_two = [r["loss"] for r in rows if r["kind"] == "train"]  # averaged across ranks
    assert losses_two == pytest.approx(losses_one, rel=1e-5)


COUNT_NO_SYNC = """
import contextlib, json, os, sys
from torch.nn.parallel import DistributedDataParallel
from trainlab.cli import main

entered = {"no_sync": 0, "forward_in_no_sync": 0}
inside = [False]
original_no_sync, original_forward = DistributedDataParallel.no_sync, DistributedDataParallel.forward

@contextlib.contextmanager
def counting_no_sync(self):
    entered["no_sync"] += 1
    inside[0] = True
    with original_no_sync(self):
        yield
    inside[0] = False

def counting_forward(self, *args, **kwargs):
    entered["forward_in_no_sync"] += inside[0]
    return original_forward(self, *args, **kwargs)

DistributedDataParallel.no_sync = counting_no_sync
DistributedDataParallel.forward = counting_forward
code = main(sys.argv[1:])
with open(os.path.join(os.environ["COUNT_DIR"], f"rank{os.environ['RANK']}.json"), "w") as f:
    json.dump(entered, f)
sys.exit(code)
"""


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=needs_compiler, id="compile")])
def test_ddp_accumulation_runs_early_micro_steps_in_no_sync(
    tmp_path: Path, python: str, run_env: dict[str, str], compiled: bool
) -> None:
    """2 processes x 2 micro-steps x 4 = 1 process x 16; the first micro-step's forward and backward skip the
    all-reduce (inside `no_sync`), once per optimizer step on every rank. With `--compile` the DDP wrapper is compiled
    (torch's order: wrap, then compile): the same steps, the same `no_sync`, against the same eager single process."""
    one, two = tmp_path / "one", tmp_path / "two"
    script = tmp_path / "count_no_sync.py"
    script.write_text(COUNT_NO_SYNC)
    _train_one_process(python, one, run_env)
    torchrun = [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    launched = subprocess.run(
        [*torchrun, *COMMON, "--grad-accumulation", "2", "--compile", str(compiled).lower(), "--run-dir", str(two)],
        env={**run_env, "COUNT_DIR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert launched.returncode == 0, launched.stderr[-3000:]
    assert ("compile: torch.compile" in launched.stderr) == compiled
    a = load_checkpoint(one / "ckpt" / "last.pt")["models"]["model"]
    b = load_checkpoint(two / "ckpt" / "last.pt")["models"]["model"]
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-5)
    for rank in (0, 1):
        counts = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert counts == {"no_sync": 5, "forward_in_no_sync": 5}, (rank, counts)  # 5 optimizer steps


def test_workers_stop_when_the_torchrun_parent_is_killed(tmp_path: Path, python: str, run_env: dict[str, str]) -> None:
    """SIGKILL of the launcher: the workers get SIGTERM (PR_SET_PDEATHSIG), save and exit instead of training on."""
    import signal
    import time

    import psutil

    run = tmp_path / "orphans"
    args = [*COMMON[:6], "--epochs", "200", "--step-sleep-seconds", "0.1", "--device", "cpu", "--tensorboard", "false"]
    launcher = subprocess.Popen(
        [
            python,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "-m",
            "trainlab",
            *args,
            "--run-dir",
            str(run),
        ],
        env=run_env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        metrics = run / "metrics.jsonl"
        while time.monotonic() < deadline and not (metrics.is_file() and '"train"' in metrics.read_text()):
            time.sleep(0.2)  # wait for the first optimizer step: the workers are training
        workers = psutil.Process(launcher.pid).children(recursive=True)
        assert len(workers) >= 2
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        _, alive = psutil.wait_procs(workers, timeout=60)
        assert alive == [], f"{len(alive)} orphaned worker(s) still running"
        assert load_checkpoint(run / "ckpt" / "last.pt")["step"] > 0  # they saved on the way out
    finally:
        for p in psutil.Process().children(recursive=True):
            p.kill()


def _error_lines(stderr: str) -> list[str]:
    """The workers' one-line errors (torchrun's own failure summary quotes them indented, after 'traceback :')."""
    return [line for line in stderr.splitlines() if line.startswith("trainlab ") and ": error: " in line]


@pytest.mark.parametrize(
    ("flags", "code", "message"),
    [
        (["--batch-size", "33"], 2, "batch size 33 does not split into 1 accumulation step(s) x 2 process(es)"),
        (["--optim.learning-rate", "1e6", "--checkpoint-every", "1"], 1, "training diverged at step"),
    ],
    ids=["usage-error", "diverged"],
)
def test_trainlab_launch_exits_with_the_workers_code_and_one_line(
    tmp_path: Path, python: str, run_env: dict[str, str], flags: list[str], code: int, message: str
) -> None:
    """`trainlab launch` is torchrun without its ChildFailedError traceback: rank 0's line, the workers' exit code."""
    launch = [python, "-m", "trainlab", "launch", "--standalone", "--nproc-per-node", "2"]
    launched = subprocess.run(
        [*launch, *COMMON, *flags, "--max-steps", "-1", "--run-dir", str(tmp_path / "run")],
        env=run_env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert launched.returncode == code, launched.stderr[-3000:]
    lines = _error_lines(launched.stderr)
    assert len(lines) == 1 and lines[0].startswith("trainlab train: error: ") and message in lines[0], lines
    assert "Traceback" not in launched.stderr and "ChildFailedError" not in launched.stderr


def test_plain_torchrun_gets_one_line_from_rank_0_and_exit_2_from_every_rank(
    tmp_path: Path, python: str, run_env: dict[str, str]
) -> None:
    """A second job on a locked run dir: only rank 0 can see the lock, every rank stops with it (no hang, no
    SIGTERM from the launcher). torchrun itself still raises ChildFailedError (exit 1), quoting the line."""
    code = (
        "import sys, time; from pathlib import Path; from trainlab.engine.run_lock import RunDirLock; "
        "lock = RunDirLock(Path(sys.argv[1])); lock.acquire(); print('locked', flush=True); time.sleep(120)"
    )
    run = tmp_path / "run"
    holder = subprocess.Popen([python, "-c", code, str(run)], stdout=subprocess.PIPE, text=True, env=run_env)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        torchrun = [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "trainlab"]
        launched = subprocess.run(
            [*torchrun, *COMMON, "--run-dir", str(run)],
            env=run_env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        holder.kill()
        holder.wait()
    lines = _error_lines(launched.stderr)
    assert len(lines) == 1 and f"in use by pid {holder.pid}" in lines[0], launched.stderr[-3000:]
    assert launched.returncode == 1  # torchrun's own exit code for any failed worker
    exit_codes = [line.split(":", 1)[1].split()[0] for line in launched.stderr.splitlines() if "exitcode  :" in line]
    assert sorted(exit_codes) == ["2", "2"], launched.stderr[-3000:]
    assert launched.stderr.count("traceback : trainlab train: error: run directory") >= 1  # the summary quotes it
