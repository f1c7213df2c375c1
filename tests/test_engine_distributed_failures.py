"""Named DDP failures, in real 2-process gloo runs through torchrun: a parameter without a gradient is named at the
first step with the two fixes (PyTorch's own "Expected to have finished reduction" error is translated into the same
line), and a rank that does not reach a collective is named instead of a silent hang."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

UNUSED_LINEAR = """
import sys
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from trainlab import dist
from trainlab.engine.loop import Trainer
from trainlab.engine.recipe import Phase, TrainParts
from trainlab.errors import UsageError
from trainlab.recipes.toy import ToyConfig, ToyRecipe

class WithUnused(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        self.unused = nn.Linear(4, 4)  # built, never called: no gradient

    def forward(self, x):
        return self.net(x)

class UnusedRecipe(ToyRecipe):
    def build(self, device):
        model = WithUnused().to(device)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        return TrainParts(models={"model": model}, phases=[Phase("main", optimizer, ["model"])])

dist.init("cpu", timeout_s=120)
rank = dist.rank()
report = open(f"{sys.argv[1]}.rank{rank}.txt", "w")  # one file per rank: two processes never share a pipe


def say(line):
    print(line.replace(chr(10), " | "), file=report, flush=True)

# 1. PyTorch's own error at the second backward of a bare DDP module, through the engine's translation
ddp = DistributedDataParallel(WithUnused())
try:
    for step in range(2):
        ddp(torch.randn(2, 16)).sum().backward()
except RuntimeError as err:
    try:
        dist.raise_named(err, {"model": ddp}, step=1)
        say(f"UNTRANSLATED[{rank}] {err!r}")  # not an error the engine explains: shown by the test's failure
    except UsageError as named:
        say(f"TRANSLATED[{rank}] {named}")
else:
    say(f"NO-ERROR[{rank}] two steps of a DDP module with an unused layer raised nothing")
# 2. the engine names them itself at the first step
find_unused = sys.argv[2] == "true"
config = ToyConfig(run_dir=sys.argv[1], num_samples=64, batch_size=16, max_steps=2, device="cpu", tensorboard=False,
                   progress=False, ddp_find_unused_parameters=find_unused)
try:
    result = Trainer(UnusedRecipe(config)).fit()
    say(f"FINISHED[{rank}] {result.status} at step {result.step}")
except UsageError as err:
    say(f"ERROR[{rank}] {err}")
dist.cleanup()
"""

STUCK_RANK = """
import time
import torch
import torch.distributed as torch_dist
from trainlab import dist
from trainlab.errors import UsageError

dist.init("cpu", timeout_s=3)
if dist.rank() == 1:
    time.sleep(12)  # stuck: never joins the all-reduce nor the barrier in time
else:
    try:
        torch_dist.all_reduce(torch.ones(1))  # a training collective with the run's --dist-timeout
    except RuntimeError as err:
        try:
            dist.raise_named(err, {}, step=4)
        except UsageError as named:
            print(f"STUCK[0] {named}", flush=True)
"""


def _torchrun(python: str, script: Path, args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    torchrun = [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    return subprocess.run([*torchrun, *args], env=env, capture_output=True, text=True, timeout=300)


def _reports(run: Path, launched: subprocess.CompletedProcess[str]) -> tuple[list[str], str]:
    """Both ranks' report lines, and everything the launch printed (for a failure's message)."""
    lines = []
    for rank in (0, 1):
        path = run.parent / f"{run.name}.rank{rank}.txt"
        lines += path.read_text().splitlines() if path.exists() else []
    return lines, "\n".join(lines) + "\n" + launched.stdout + launched.stderr[-3000:]


def test_an_unused_linear_is_named_with_both_fixes(tmp_path: Path, python: str, run_env: dict[str, str]) -> None:
    script = tmp_path / "unused.py"
    script.write_text(UNUSED_LINEAR)
    launched = _torchrun(python, script, [str(tmp_path / "run"), "false"], run_env)
    lines, printed = _reports(tmp_path / "run", launched)
    for rank in (0, 1):
        error = next((line for line in lines if line.startswith(f"ERROR[{rank}]")), None)
        assert error is not None, printed
        names = error.split("received no gradient at step 1: ")[1].split(";")[0]
        assert names == "model.unused.weight, model.unused.bias", error
        assert "remove them from the model" in error and "--ddp-find-unused-parameters" in error
        translated = next((line for line in lines if line.startswith(f"TRANSLATED[{rank}]")), None)
        assert translated is not None, printed
        assert "received no gradient at step 2: model.unused.weight, model.unused.bias;" in translated
        assert "Expected to have finished reduction" in translated and "--ddp-find-unused-parameters" in translated


@pytest.mark.slow
def test_ddp_find_unused_parameters_lets_that_model_train(tmp_path: Path, python: str, run_env: dict[str, str]) -> None:
    script = tmp_path / "unused.py"
    script.write_text(UNUSED_LINEAR)
    allowed = _torchrun(python, script, [str(tmp_path / "allowed"), "true"], run_env)
    lines, printed = _reports(tmp_path / "allowed", allowed)
    assert "FINISHED[0] max_steps at step 2" in lines, printed


def test_a_rank_stuck_outside_a_collective_is_named(tmp_path: Path, python: str, run_env: dict[str, str]) -> None:
    script = tmp_path / "stuck.py"
    script.write_text(STUCK_RANK)
    launched = _torchrun(python, script, [], run_env)
    line = next((x for x in launched.stdout.splitlines() if x.startswith("STUCK[0]")), None)
    assert line is not None, launched.stdout + launched.stderr[-3000:]
    assert "rank 1 of 2 did not reach optimizer step 4 (a collective timed out after 3 s) within 3 s" in line
    assert "resume with the same command" in line
