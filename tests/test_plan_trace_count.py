"""The planner traces no more than it needs: a trace it already holds checks the micro-batch fit, and a first forward
finds the smallest micro-batch."""

from __future__ import annotations

import dataclasses

import pytest

from trainlab.engine.debug import debug_run_config
from trainlab.memory import planner
from trainlab.memory.breakdown import breakdown
from trainlab.memory.gpus import GpuProfile
from trainlab.memory.planner import PlanRequest, _Tracer, plan, smallest_micro_batch
from trainlab.memory.trace import trace_training
from trainlab.recipes.moco import MocoRecipe
from trainlab.recipes.toy import ToyRecipe


def _toy() -> ToyRecipe:
    return ToyRecipe(dataclasses.replace(debug_run_config(ToyRecipe(ToyRecipe.config_class())), batch_size=64))


def test_the_smallest_micro_batch_is_found_without_a_trace() -> None:
    tracer = _Tracer(_toy(), "cuda")
    assert smallest_micro_batch(tracer) == 1
    assert tracer.traced == 0  # the first forward at micro-batch 1 only


def test_the_configured_trace_at_accumulation_1_checks_the_fit_at_accumulation_2() -> None:
    recipe = _toy()
    tracer = _Tracer(recipe, "cuda")
    tracer(32, 1, count_flops=True)  # the plan's first trace: the configured run
    fitted = tracer(13, 2)
    assert tracer.traced == 3  # then the fit's two points; no check trace of its own
    assert tracer.fits[2] is not None and tracer.fits[1] is not None
    assert fitted == breakdown(trace_training(recipe, device="cuda", micro_batch=13, grad_accumulation=2))
    assert tracer(24, 1) == breakdown(trace_training(recipe, device="cuda", micro_batch=24, grad_accumulation=1))
    assert tracer.traced == 3


def test_without_a_trace_at_accumulation_1_the_fit_traces_its_own_check() -> None:
    tracer = _Tracer(_toy(), "cuda")
    tracer(13, 2)
    assert tracer.traced == 3 and tracer.fits[2] is not None


@pytest.mark.slow  # about 20 s: MoCo traced ten times
def test_a_quadratic_recipe_is_fitted_of_degree_2() -> None:
    """MoCo's B x B logits refuse the affine fit: the fit of degree 2 takes one more trace, and every micro-batch."""
    recipe = MocoRecipe(dataclasses.replace(debug_run_config(MocoRecipe(MocoRecipe.config_class())), batch_size=64))
    tracer = _Tracer(recipe, "cuda")
    tracer(32, 1, count_flops=True)
    fitted = tracer(13, 2), tracer(24, 1)
    assert tracer.fits[2] is not None and tracer.fits[1] is not None
    assert tracer.traced == 8  # the configured run; at accumulation 2: 4, 8, the check 6, 12; at 1: 4, 8, 12
    assert fitted[0] == breakdown(trace_training(recipe, device="cuda", micro_batch=13, grad_accumulation=2))
    assert fitted[1] == breakdown(trace_training(recipe, device="cuda", micro_batch=24, grad_accumulation=1))


def test_a_plan_where_micro_batch_2_fits_runs_no_forward_at_micro_batch_1(monkeypatch: pytest.MonkeyPatch) -> None:
    """The smallest micro-batch (a first forward at 1) matters only where 2 does not fit: a search that stays above
    it does not look for it."""
    recipe = _toy()
    ends = [
        breakdown(trace_training(recipe, device="cpu", micro_batch=m, grad_accumulation=k)).peak_reserved_bytes
        for m, k in ((2, 2), (recipe.config.batch_size, 1))
    ]
    forwards: list[int] = []
    monkeypatch.setattr(planner, "first_forward", lambda *args, **kwargs: forwards.append(kwargs["micro_batch"]))
    result = plan(recipe, PlanRequest(device="cpu", gpu=GpuProfile("tight", sum(ends) // 2, (9, 0))))
    assert result.max_micro_batch is not None and 2 < result.max_micro_batch < recipe.config.batch_size
    assert forwards == [] and result.min_micro_batch is None
