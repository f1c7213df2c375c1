"""The plan traced in worker processes is the plan traced in one process, exceptions and all."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

import trainlab.memory.planner as planner
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
