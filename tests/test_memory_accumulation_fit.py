"""Accumulation 1 derived from accumulation 2 is the traced run exactly; the planner uses it only where a real trace
agrees, and plans the same either way."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from trainlab.engine.debug import debug_run_config
from trainlab.memory.accumulation_fit import first_micro_batch_only, second_micro_batches_repeat_first
from trainlab.memory.batch_fit import _same_structure
from trainlab.memory.breakdown import breakdown
from trainlab.memory.gpus import GpuProfile
from trainlab.memory.planner import PlanRequest, _Tracer, plan
from trainlab.memory.trace import TracedRun, trace_training
from trainlab.memory.tracer import StorageRecord, Trace
from trainlab.recipes.cifar import CifarRecipe
from trainlab.recipes.toy import ToyRecipe
from trainlab.recipes.var import VARRecipe


def _recipe(cls: type, **changes: object) -> Any:
    return cls(dataclasses.replace(debug_run_config(cls(cls.config_class())), **{"batch_size": 64, **changes}))


@pytest.mark.parametrize(
    ("cls", "precision"),
    [
        (ToyRecipe, "fp32"),
        (CifarRecipe, "fp32"),
        pytest.param(VARRecipe, "fp16-amp-scale", marks=pytest.mark.slow),  # about 8 s
    ],
)
def test_the_first_micro_batch_of_accumulation_2_is_accumulation_1(cls: type, precision: str) -> None:
    recipe = _recipe(cls, precision=precision)
    two = trace_training(recipe, device="cuda", micro_batch=4, grad_accumulation=2)
    one = trace_training(recipe, device="cuda", micro_batch=4, grad_accumulation=1)
    derived = first_micro_batch_only(two)
    assert derived is not None and derived.grad_accumulation == 1
    assert _same_structure(derived, one)
    assert [r.nbytes for r in derived.trace.records] == [r.nbytes for r in one.trace.records]
    assert breakdown(derived) == breakdown(one)


def _run(events: list[tuple[int, int]], nbytes: list[int], windows: list[tuple[int, int, int]]) -> TracedRun:
    """A hand-made accumulation-2 run: one step per (first micro-batch, second micro-batch, unscale) position."""
    records = [StorageRecord(i, n, "forward", 0) for i, n in enumerate(nbytes)]
    trace = Trace(
        records=records,
        events=events,
        step_starts=[w[0] for w in windows],
        end=len(events),
        micro_step_starts=[p for w in windows for p in w[:2]],
        micro_steps_ends=[w[2] for w in windows],
    )
    return TracedRun(trace, "cuda", 4, 2, 0, 0, 0, 0, False, ["sgd"])


def test_a_replacement_takes_over_the_free_of_what_it_replaced() -> None:
    # 0: kept state; 1: first micro-batch's running sum; 2: a temporary of the second; 3: the sum it replaces 1 with
    events = [(1, 0), (1, 1), (1, 2), (1, 3), (-1, 1), (-1, 2), (-1, 3)]
    derived = first_micro_batch_only(_run(events, [8, 4, 16, 4], [(0, 2, 6)]))
    assert derived is not None
    assert derived.trace.events == [(1, 0), (1, 1), (-1, 1)]
    assert [r.nbytes for r in derived.trace.records] == [8, 4]


def test_what_does_not_pair_up_gives_no_derived_trace() -> None:
    # the second micro-batch frees the first one's record and keeps one of other bytes: no one-to-one replacement
    events = [(1, 0), (1, 1), (-1, 0), (-1, 1)]
    assert first_micro_batch_only(_run(events, [4, 8], [(0, 1, 3)])) is None
    events = [(1, 0), (-1, 0)]  # freed, nothing kept in its place
    assert first_micro_batch_only(_run(events, [4], [(0, 1, 2)])) is None


def test_a_second_micro_batch_may_allocate_less_than_the_first_but_nothing_else() -> None:
    # step: first micro-batch allocates 4, 8 and a 16-byte gradient copy; the second 4 and 8 (accumulated in place)
    events = [(1, 0), (1, 1), (1, 2), (-1, 0), (-1, 1), (1, 3), (1, 4), (-1, 3), (-1, 4), (-1, 2)]
    windows = [(0, 5, 9)]
    low = _run(events, [4, 8, 16, 4, 8], windows)
    high = dataclasses.replace(_run(events, [8, 16, 16, 8, 16], windows), micro_batch=8)
    assert second_micro_batches_repeat_first(low, high)
    other = dataclasses.replace(_run(events, [8, 16, 16, 8, 32], windows), micro_batch=8)  # 32: not the first's
    assert not second_micro_batches_repeat_first(low, other)
    # matched in other places at the other micro-batch: not the same storages
    moved = dataclasses.replace(_run(events, [8, 16, 8, 8, 16], windows), micro_batch=8)
    shifted = dataclasses.replace(_run(events, [8, 8, 16, 8, 16], windows), micro_batch=8)
    assert second_micro_batches_repeat_first(low, moved)
    assert not second_micro_batches_repeat_first(low, shifted)


def _plans(recipe: Any, gpu: GpuProfile, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Any]:
    """The plan as it is, and with both shortcuts off (every fit checked by a trace at its own accumulation)."""
    fast = plan(recipe, PlanRequest(device="cpu", gpu=gpu, gpus=2))
    with monkeypatch.context() as m:
        m.setattr(_Tracer, "_fit_from_accumulation_2", lambda self: None)
        m.setattr(_Tracer, "_fit_checked_at_accumulation_1", lambda self, low, high: None)
        slow = plan(recipe, PlanRequest(device="cpu", gpu=gpu, gpus=2))
    return fast, slow


def _tight_gpu(recipe: Any) -> GpuProfile:
    """A GPU between micro-batch 2 and the per-GPU batch of 2 GPUs: the search traces accumulation 2 first."""
    ends = [
        breakdown(trace_training(recipe, device="cpu", micro_batch=m, grad_accumulation=k)).peak_reserved_bytes
        for m, k in ((2, 2), (recipe.config.batch_size // 2, 1))
    ]
    return GpuProfile("tight", (ends[0] + ends[1]) // 2, (9, 0))


@pytest.mark.parametrize(
    ("cls", "precision", "batch"),
    [
        (ToyRecipe, "fp32", 512),
        pytest.param(VARRecipe, "fp16-amp-scale", 64, marks=pytest.mark.slow),  # about a minute: two plans
    ],
)
def test_the_derived_fit_plans_what_the_traced_fit_plans(
    cls: type, precision: str, batch: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    recipe = _recipe(cls, batch_size=batch, precision=precision)
    fast, slow = _plans(recipe, _tight_gpu(recipe), monkeypatch)
    assert fast.max_micro_batch is not None and fast.max_micro_batch < batch // 2  # the search ran below the batch
    assert fast.traces < slow.traces
    assert dataclasses.replace(fast, traces=0) == dataclasses.replace(slow, traces=0)


def test_a_derived_fit_the_real_trace_refutes_falls_back_to_tracing(monkeypatch: pytest.MonkeyPatch) -> None:
    import trainlab.memory.planner as planner

    def off_by_one_block(run: TracedRun) -> TracedRun | None:
        derived = first_micro_batch_only(run)
        assert derived is not None
        records = list(derived.trace.records)
        records[-1] = dataclasses.replace(records[-1], nbytes=records[-1].nbytes + 512)
        return dataclasses.replace(derived, trace=dataclasses.replace(derived.trace, records=records))

    recipe = _recipe(ToyRecipe, batch_size=512)
    gpu = _tight_gpu(recipe)
    right = plan(recipe, PlanRequest(device="cpu", gpu=gpu, gpus=2))
    monkeypatch.setattr(planner, "first_micro_batch_only", off_by_one_block)
    wrong = plan(recipe, PlanRequest(device="cpu", gpu=gpu, gpus=2))
    assert wrong.traces > right.traces  # the refuted derivation cost traces of accumulation 1
    assert dataclasses.replace(wrong, traces=0) == dataclasses.replace(right, traces=0)
