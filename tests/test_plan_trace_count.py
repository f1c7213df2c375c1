"""The planner traces no more than it needs: a trace it already holds checks the micro-batch fit."""

from __future__ import annotations

import dataclasses

from trainlab.engine.debug import debug_run_config
from trainlab.memory.breakdown import breakdown
from trainlab.memory.planner import _Tracer, smallest_micro_batch
from trainlab.memory.trace import trace_training
from trainlab.recipes.toy import ToyRecipe


def test_the_smallest_micro_batch_trace_checks_the_fit() -> None:
    recipe = ToyRecipe(dataclasses.replace(debug_run_config(ToyRecipe(ToyRecipe.config_class())), batch_size=64))
    tracer = _Tracer(recipe, "cuda")
    assert smallest_micro_batch(tracer) == 1
    fitted = tracer(13, 2)
    assert tracer.traced == 3  # micro-batch 1, then the fit's two points; no check trace of its own
    assert tracer.fits[2] is not None
    assert fitted == breakdown(trace_training(recipe, device="cuda", micro_batch=13, grad_accumulation=2))
