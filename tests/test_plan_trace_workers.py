"""The plan traced in worker processes is the plan traced in one process, exceptions and all."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import trainlab.memory.planner as planner
import trainlab.memory.trace_workers as trace_workers
from trainlab.engine.debug import debug_run_config
from trainlab.memory.breakdown import breakdown
from trainlab.memory.gpus import GpuProfile
from trainlab.memory.planner import PlanRequest, plan
from trainlab.memory.trace import TracedRun, trace_training
from trainlab.memory.trace_workers import MAX_WORKERS, TraceJob, TraceWorkers, auto_workers
from trainlab.recipes.cifar import CifarRecipe
from trainlab.recipes.toy import ToyRecipe


def _recipe(cls: type, **changes: object) -> Any:
    return cls(dataclasses.replace(debug_run_config(cls(cls.config_class())), **changes))


def _tight_gpu(recipe: Any) -> GpuProfile:
    """A GPU between micro-batch 2 and the per-GPU batch: the search runs below the batch."""
    ends = [
        breakdown(trace_training(recipe, device="cpu", micro_batch=m, grad_accumulation=k)).peak_reserved_bytes
        for m, k in ((2, 2), (recipe.config.batch_size, 1))
    ]
    return GpuProfile("tight", (ends[0] + ends[1]) // 2, (9, 0))


@pytest.mark.parametrize(
    ("cls", "changes"),
    [
        (ToyRecipe, {"batch_size": 256}),  # no activation checkpointing: that lever's trace raises in a worker
        (CifarRecipe, {"batch_size": 64, "precision": "fp32"}),  # BatchNorm; the bf16 lever's trace
    ],
)
def test_workers_plan_what_one_process_plans(
    cls: type, changes: dict[str, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    recipe = _recipe(cls, **changes)
    gpu = _tight_gpu(recipe)
    alone = plan(recipe, PlanRequest(device="cpu", gpu=gpu))
    taken: list[TraceJob] = []

    class Counted(TraceWorkers):
        def take(self, job: TraceJob) -> TracedRun:
            taken.append(job)
            return super().take(job)

    monkeypatch.setattr(planner, "TraceWorkers", Counted)
    forked = plan(recipe, PlanRequest(device="cpu", gpu=gpu, workers=2))
    assert len(taken) >= 3  # the configured run and the fit's two points, at least, came from the workers
    assert forked.max_micro_batch is not None and 0 < forked.max_micro_batch < recipe.config.batch_size
    assert forked == alone
    assert {lever.name for lever in forked.levers} >= {"activation checkpointing", "smaller micro-batch"}


def test_a_trace_that_raises_in_a_worker_raises_in_the_planner() -> None:
    recipe = _recipe(ToyRecipe)
    job = TraceJob(4, 1, recipe.config.precision, checkpointing=True, count_flops=False)
    workers = TraceWorkers(recipe, "cuda", [job, dataclasses.replace(job, checkpointing=False)], workers=2)
    try:
        with pytest.raises(Exception, match="--activation-checkpointing is not implemented by recipe 'toy'"):
            workers.take(job)
        run = workers.take(dataclasses.replace(job, checkpointing=False))
    finally:
        workers.close()
    assert breakdown(run) == breakdown(trace_training(recipe, device="cuda", micro_batch=4, grad_accumulation=1))


def test_auto_workers_is_the_cores_at_most_four() -> None:
    assert 1 <= auto_workers() <= MAX_WORKERS


def test_the_probe_says_no_where_a_forked_child_cannot_run_autograd(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a child forked after the autograd engine started its threads sees (on CUDA machines, or after some traced
    backward passes): its backward raises. The probe's child inherits the failing backward and answers no."""

    def refused(*args: object, **kwargs: object) -> None:
        raise RuntimeError("Unable to handle autograd's threading in combination with fork-based multiprocessing")

    monkeypatch.setattr(torch.Tensor, "backward", refused)
    assert not trace_workers.fork_runs_autograd()


def test_a_probe_child_that_does_not_answer_is_killed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.Tensor, "backward", lambda *args, **kwargs: time.sleep(60))  # the child hangs
    monkeypatch.setattr(trace_workers, "PROBE_SECONDS", 0.5)
    started = time.monotonic()
    assert not trace_workers.fork_runs_autograd()
    assert time.monotonic() - started < 10


FORKED_PLAN = """
import dataclasses, sys
import trainlab.memory.planner as planner
from trainlab.engine.debug import debug_run_config
from trainlab.memory.gpus import GpuProfile
from trainlab.memory.planner import PlanRequest, plan
from trainlab.recipes.toy import ToyRecipe

methods = []


class Recorded(planner.TraceWorkers):
    def close(self):
        methods.append(self.start_method)
        super().close()


if __name__ == "__main__":
    planner.TraceWorkers = Recorded
    recipe = ToyRecipe(dataclasses.replace(debug_run_config(ToyRecipe(ToyRecipe.config_class())), batch_size=256))
    gpu = GpuProfile("tight", int(sys.argv[1]), (9, 0))
    forked = plan(recipe, PlanRequest(device="cpu", gpu=gpu, workers=2))  # first: no backward pass has run here
    alone = plan(recipe, PlanRequest(device="cpu", gpu=gpu))
    print(methods, forked == alone, forked.max_micro_batch)
"""


def test_a_fresh_planner_forks_its_workers_and_plans_what_one_process_plans(tmp_path: Path) -> None:
    recipe = _recipe(ToyRecipe, batch_size=256)
    capacity = _tight_gpu(recipe).total_bytes
    script = tmp_path / "forked_plan.py"
    script.write_text(FORKED_PLAN)
    done = subprocess.run([sys.executable, str(script), str(capacity)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    methods, same, largest = done.stdout.split("]")[0] + "]", *done.stdout.split("]")[1].split()
    assert methods == "['fork']" and same == "True"
    assert 0 < int(largest) < 256


def test_fork_server_workers_plan_what_one_process_plans(monkeypatch: pytest.MonkeyPatch) -> None:
    recipe = _recipe(ToyRecipe, batch_size=256)
    gpu = _tight_gpu(recipe)
    alone = plan(recipe, PlanRequest(device="cpu", gpu=gpu))
    methods: list[str] = []

    class Recorded(TraceWorkers):
        def close(self) -> None:
            methods.append(self.start_method)
            super().close()

    monkeypatch.setattr(planner, "fork_runs_autograd", lambda: False)  # as where a fork cannot run autograd
    monkeypatch.setattr(planner, "TraceWorkers", Recorded)
    assert plan(recipe, PlanRequest(device="cpu", gpu=gpu, workers=2)) == alone
    assert methods == ["forkserver"]


def test_a_worker_that_dies_is_an_error_and_close_never_waits_on_it() -> None:
    """A worker killed mid-trace (the OOM killer, a signal) is one error from `take`; `close` kills the others and
    returns at once (multiprocessing.Pool's terminate waited forever on a lock a killed idle worker held)."""
    recipe = _recipe(ToyRecipe, batch_size=256)
    jobs = [TraceJob(m, 1, recipe.config.precision, checkpointing=False, count_flops=False) for m in (64, 128, 256)]
    workers = TraceWorkers(recipe, "cpu", jobs, workers=2)
    try:
        (process, _), _ = workers._running.values()
        os.kill(process.pid, signal.SIGKILL)
        with pytest.raises(RuntimeError, match=r"planner worker tracing .* died \(exit code -9\)"):
            workers.take(jobs[0])
        assert breakdown(workers.take(jobs[2])) == breakdown(
            trace_training(recipe, device="cpu", micro_batch=256, grad_accumulation=1)
        )
    finally:
        started = time.monotonic()
        workers.close()
        assert time.monotonic() - started < 10


@pytest.mark.timeout(180)
def test_sigterm_to_the_whole_process_group_ends_a_plan(tmp_path: Path, python: str, run_env: dict[str, str]) -> None:
    """`timeout`, batch schedulers and `docker stop` signal every process of the group: planner and workers alike.
    The plan ends with its one line (143) or, where it finished first, 0; it never hangs."""
    command = [python, "-m", "trainlab", "plan", "var", "--config", "var_d16", "--gpu", "all"]  # ~10 s on 2 cores
    plan_process = subprocess.Popen(
        command, env=run_env, cwd=tmp_path, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    assert plan_process.stderr is not None
    for line in plan_process.stderr:
        if "worker processes at once" in line:
            break
    time.sleep(0.5)
    os.killpg(plan_process.pid, signal.SIGTERM)
    try:
        rest = plan_process.stderr.read()
        code = plan_process.wait(timeout=60)
    finally:
        if plan_process.poll() is None:
            os.killpg(plan_process.pid, signal.SIGKILL)
    assert code in (0, 143), rest[-2000:]
    if code == 143:
        assert rest.strip().splitlines()[-1] == "trainlab plan: terminated (SIGTERM)", rest[-2000:]


def test_close_returns_when_every_worker_was_killed_between_traces() -> None:
    """The process group's SIGTERM reaches the workers too, between two traces as well as during one: `close` (run
    by the planner as it unwinds) must not wait on anything a killed worker held."""
    recipe = _recipe(ToyRecipe, batch_size=256)
    job = TraceJob(64, 1, recipe.config.precision, checkpointing=False, count_flops=False)
    workers = TraceWorkers(recipe, "cpu", [job], workers=1)
    workers.take(job)
    for child in multiprocessing.active_children():
        os.kill(child.pid, signal.SIGTERM)
    closer = threading.Thread(target=workers.close, daemon=True)
    closer.start()
    closer.join(timeout=20)
    assert not closer.is_alive()
