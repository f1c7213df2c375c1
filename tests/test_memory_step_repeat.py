"""A copied last step is the traced one: every recipe whose last step repeats the one before it gets, with
`repeat_last_step`, the trace of three real steps; MoCo's last step (no momentum update after it) does not, and says
so; and a planner whose copies are wrong plans what it plans without copies."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from trainlab.engine.debug import debug_run_config
from trainlab.memory import step_repeat
from trainlab.memory import trace as trace_module
from trainlab.memory.batch_fit import _canonical
from trainlab.memory.breakdown import breakdown
from trainlab.memory.planner import _Tracer
from trainlab.memory.trace import trace_training
from trainlab.memory.tracer import Trace
from trainlab.recipes import get_recipe, list_recipes


def _recipe(name: str, **changes: Any) -> Any:
    cls = get_recipe(name)
    return cls(dataclasses.replace(debug_run_config(cls(cls.config_class())), **changes))


def _same(a: Trace, b: Trace) -> bool:
    return (
        a.records == b.records
        and _canonical(a.events) == _canonical(b.events)
        and (a.step_starts, a.end, a.micro_step_starts, a.micro_steps_ends)
        == (b.step_starts, b.end, b.micro_step_starts, b.micro_steps_ends)
    )


SLOW = {"tokenizer", "var"}  # about 8 and 5 s; var's case below covers it
CASES = [pytest.param(name, {}, marks=pytest.mark.slow) if name in SLOW else (name, {}) for name in list_recipes()] + [
    ("var", {"activation_checkpointing": True}),  # recomputation inside the backward
    ("cifar", {"precision": "fp16-amp-scale"}),  # loss scaling: what a step leaves for the next
]


@pytest.mark.parametrize(("name", "changes"), CASES)
@pytest.mark.parametrize("accumulation", [1, 2])
def test_a_copied_last_step_is_the_traced_one_where_the_recipe_says_so(
    name: str, changes: dict[str, Any], accumulation: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    recipe = _recipe(name, **changes)
    copies: list[Trace | None] = []

    def spied(trace: Trace) -> Trace | None:
        copies.append(step_repeat.repeat_last_step(trace))
        return copies[-1]

    monkeypatch.setattr(trace_module, "repeat_last_step", spied)
    real, copied = (
        trace_training(recipe, device="cuda", micro_batch=4, grad_accumulation=accumulation, repeat_last_step=repeat)
        for repeat in (False, True)
    )
    assert len(copies) == 1
    if copies[0] is None:  # the trace has no shape for a copy: the step was traced
        assert _same(copied.trace, real.trace) and name == "tokenizer"  # its discriminator's phase
        return
    assert _same(copied.trace, real.trace) == recipe.last_step_repeats_previous
    if recipe.last_step_repeats_previous:
        assert breakdown(copied) == breakdown(real)


def test_a_copy_refuses_a_step_that_frees_what_an_older_step_left() -> None:
    records = [step_repeat.StorageRecord(i, 512, "forward", s) for i, s in enumerate([-1, 0, 1])]
    kept = Trace(records=records, events=[(1, 0), (1, 1), (1, 2), (-1, 1)], step_starts=[1, 2])
    assert step_repeat.repeat_last_step(kept) is not None  # step 1 frees step 0's storage, leaves its own
    older = Trace(records=records, events=[(1, 0), (1, 1), (1, 2), (-1, 0)], step_starts=[1, 2])
    assert step_repeat.repeat_last_step(older) is None  # step 1 frees the set-up's


def test_a_planner_whose_copied_steps_are_wrong_plans_as_without_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    """Copies that differ from the real steps (here: one storage of each copied step a block larger) make the fit
    through them fail its check against the real configured trace: the planner traces the points again in full and
    answers with real traces."""

    def wrong(trace: Trace) -> Trace | None:
        copy = step_repeat.repeat_last_step(trace)
        if copy is not None:
            copy.records[-1] = dataclasses.replace(copy.records[-1], nbytes=copy.records[-1].nbytes + 512)
        return copy

    monkeypatch.setattr(trace_module, "repeat_last_step", wrong)
    recipe = _recipe("toy", batch_size=64)
    tracer = _Tracer(recipe, "cuda")
    tracer(32, 1, count_flops=True)  # the configured run
    fitted = tracer(13, 2)
    assert not tracer.copies and not tracer.copied  # tried, then given up
    assert tracer.fits[2] is not None
    monkeypatch.undo()
    assert fitted == breakdown(trace_training(recipe, device="cuda", micro_batch=13, grad_accumulation=2))
    assert tracer(8, 2) == breakdown(trace_training(recipe, device="cuda", micro_batch=8, grad_accumulation=2))


def test_the_fit_points_are_copies_where_the_fit_through_them_holds() -> None:
    recipe = _recipe("toy", batch_size=64)
    tracer = _Tracer(recipe, "cuda")
    tracer(32, 1, count_flops=True)
    fitted = tracer(13, 2)
    assert tracer.copied == {(4, 2), (8, 2)} and tracer.fits[2] is not None
    assert fitted == breakdown(trace_training(recipe, device="cuda", micro_batch=13, grad_accumulation=2))
    assert tracer(8, 2) == breakdown(trace_training(recipe, device="cuda", micro_batch=8, grad_accumulation=2))
